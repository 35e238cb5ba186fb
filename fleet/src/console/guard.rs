//! The console's request rules, without IO: which `Host` and `Origin` it answers, the headers
//! every response carries, and the browser sessions a token opens. `server` applies them to
//! each request; docs/console.md gives each rule's reason.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// Headers on every response: no script but the console's own file, no inline script or
/// handler, no framing, no content sniffing, no referrer (a URL never leaves the page).
pub const SECURITY_HEADERS: [(&str, &str); 6] = [
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
         connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
];

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("Host {0:?} is not this console's address (a DNS-rebinding page sends its own name)")]
    ForeignHost(String),
    #[error("no Host header")]
    NoHost,
    #[error("Origin {0:?} is not this console (a state change from another site's page)")]
    ForeignOrigin(String),
}

/// The names and addresses the console answers to: its listening address (an IP literal; any
/// IP literal when it listens on all addresses), `localhost` when it listens on loopback or on
/// all addresses, and the host of `--public-url`. A DNS-rebinding attack always arrives with
/// the attacker's DNS name in `Host`, never with an IP literal.
#[derive(Debug, Clone)]
pub struct Site {
    listen: SocketAddr,
    public: Option<(String, Option<u16>)>,
    /// `--public-url`'s origin (`https://name[:port]`): what a page served through a proxy
    /// calls itself.
    public_origin: Option<String>,
    /// `https` or `http`: what the page's own origin starts with.
    scheme: &'static str,
}

impl Site {
    /// `public_url` is `scheme://host[:port][/...]` (as a proxy in front publishes it).
    pub fn new(listen: SocketAddr, public_url: Option<&str>, tls: bool) -> Result<Self, String> {
        let mut public_origin = None;
        let public = match public_url {
            None => None,
            Some(u) => {
                let rest = u
                    .strip_prefix("https://")
                    .or_else(|| u.strip_prefix("http://"))
                    .ok_or_else(|| format!("--public-url {u}: not an http:// or https:// URL"))?;
                let authority = rest.split('/').next().unwrap_or_default();
                let (host, port) =
                    split_host(authority).ok_or_else(|| format!("--public-url {u}: no host"))?;
                let scheme = if u.starts_with("https://") {
                    "https"
                } else {
                    "http"
                };
                public_origin = Some(format!("{scheme}://{}", authority.to_ascii_lowercase()));
                Some((host.to_ascii_lowercase(), port))
            }
        };
        Ok(Self {
            listen,
            public,
            public_origin,
            scheme: if tls { "https" } else { "http" },
        })
    }

    /// Accepts a `Host` header naming this console.
    pub fn check_host(&self, host: Option<&str>) -> Result<(), Refusal> {
        let raw = host.ok_or(Refusal::NoHost)?;
        let foreign = || Refusal::ForeignHost(raw.chars().take(200).collect());
        let (name, port) = split_host(raw).ok_or_else(foreign)?;
        let name = name.to_ascii_lowercase();
        if let Some((public, public_port)) = &self.public
            && name == *public
            && (port == *public_port || port.is_none())
        {
            return Ok(());
        }
        if port.unwrap_or(default_port(self.scheme)) != self.listen.port() {
            return Err(foreign());
        }
        let ip = self.listen.ip();
        let ours = match name
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            Ok(given) => ip.is_unspecified() || given == ip,
            Err(_) => name == "localhost" && (ip.is_loopback() || ip.is_unspecified()),
        };
        if ours { Ok(()) } else { Err(foreign()) }
    }

    /// Accepts a state-changing request whose `Origin` (when a browser sent one) is this
    /// console's own, as named by the request's (checked) `Host`. Scripts (curl) send none.
    pub fn check_origin(&self, origin: Option<&str>, host: &str) -> Result<(), Refusal> {
        match origin {
            None => Ok(()),
            Some(o) if o.eq_ignore_ascii_case(&format!("{}://{host}", self.scheme)) => Ok(()),
            Some(o) if self.public_origin.as_deref() == Some(&*o.to_ascii_lowercase()) => Ok(()),
            Some(o) => Err(Refusal::ForeignOrigin(o.chars().take(200).collect())),
        }
    }
}

fn default_port(scheme: &str) -> u16 {
    if scheme == "https" { 443 } else { 80 }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn split_host(authority: &str) -> Option<(&str, Option<u16>)> {
    if authority.is_empty() || authority.contains(['@', '/', ' ']) {
        return None;
    }
    let (host, port) = if authority.starts_with('[') {
        let end = authority.find(']')?;
        let (h, rest) = authority.split_at(end + 1);
        match rest.strip_prefix(':') {
            Some(p) => (h, Some(p)),
            None if rest.is_empty() => (h, None),
            None => return None,
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => Some(p.parse().ok()?),
        None => None,
    };
    (!host.is_empty()).then_some((host, port))
}

/// Browser sessions: a random id handed out as a cookie when the token is presented once; each
/// ends `ttl` after it began. At most `max` at once (the oldest goes first).
pub struct Sessions {
    ttl: Duration,
    max: usize,
    open: HashMap<String, Instant>,
}

impl Sessions {
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            ttl,
            max: max.max(1),
            open: HashMap::new(),
        }
    }

    /// A new session from `now`; its id (64 hex digits from the OS's random source).
    pub fn open(&mut self, now: Instant) -> String {
        self.open
            .retain(|_, began| now.duration_since(*began) < self.ttl);
        while self.open.len() >= self.max {
            let oldest = self
                .open
                .iter()
                .min_by_key(|(_, t)| **t)
                .map(|(k, _)| k.clone())
                .expect("not empty");
            self.open.remove(&oldest);
        }
        let id = hex::encode(rand::random::<[u8; 32]>());
        self.open.insert(id.clone(), now);
        id
    }

    /// Whether `id` names a session that has not ended at `now`.
    pub fn valid(&self, id: &str, now: Instant) -> bool {
        self.open
            .get(id)
            .is_some_and(|began| now.duration_since(*began) < self.ttl)
    }
}

/// The request's query without its `token` parameter (where a browser is sent after logging in),
/// always a path on this site (`//evil.example` or `/\\evil.example` would leave it).
pub fn without_token(path: &str, query: Option<&str>) -> String {
    let path = format!("/{}", path.trim_start_matches(['/', '\\']));
    let rest: Vec<&str> = query
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty() && !kv.starts_with("token=") && *kv != "token")
        .collect();
    if rest.is_empty() {
        path
    } else {
        format!("{path}?{}", rest.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(listen: &str, public: Option<&str>, tls: bool) -> Site {
        Site::new(listen.parse().unwrap(), public, tls).unwrap()
    }

    #[test]
    fn hosts_a_console_answers_to() {
        let lo = site("127.0.0.1:8080", None, false);
        for ok in ["127.0.0.1:8080", "localhost:8080", "LOCALHOST:8080"] {
            assert_eq!(lo.check_host(Some(ok)), Ok(()), "{ok}");
        }
        for bad in [
            "attacker.example",
            "attacker.example:8080",
            "127.0.0.1:9090",
            "127.0.0.2:8080",
            "localhost",
            "127.0.0.1:8080@evil",
            "",
        ] {
            assert!(lo.check_host(Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(lo.check_host(None), Err(Refusal::NoHost));
        let v6 = site("[::1]:8080", None, false);
        assert_eq!(v6.check_host(Some("[::1]:8080")), Ok(()));
        assert!(v6.check_host(Some("[::2]:8080")).is_err());
        // On all addresses: any IP literal on its port, never a DNS name but the public one.
        let any = site("0.0.0.0:8443", Some("https://console.lan:8443/"), true);
        assert_eq!(any.check_host(Some("192.168.1.20:8443")), Ok(()));
        assert_eq!(any.check_host(Some("console.lan:8443")), Ok(()));
        assert!(any.check_host(Some("rebind.example:8443")).is_err());
        assert!(any.check_host(Some("192.168.1.20:9999")).is_err());
        // Behind a proxy on 443: the public name without a port.
        let proxied = site("127.0.0.1:8080", Some("https://fleet.example.com"), false);
        assert_eq!(proxied.check_host(Some("fleet.example.com")), Ok(()));
        assert!(proxied.check_host(Some("fleet.example.com.evil")).is_err());
        assert!(Site::new("127.0.0.1:1".parse().unwrap(), Some("ftp://x"), false).is_err());
    }

    #[test]
    fn origins_a_state_change_may_come_from() {
        let lo = site("127.0.0.1:8080", None, false);
        assert_eq!(lo.check_origin(None, "127.0.0.1:8080"), Ok(()));
        assert_eq!(
            lo.check_origin(Some("http://127.0.0.1:8080"), "127.0.0.1:8080"),
            Ok(())
        );
        for bad in ["http://attacker.example", "null", "https://127.0.0.1:8080"] {
            assert!(
                lo.check_origin(Some(bad), "127.0.0.1:8080").is_err(),
                "{bad}"
            );
        }
        let proxied = site("127.0.0.1:8080", Some("https://Fleet.example.com/"), false);
        assert_eq!(
            proxied.check_origin(Some("https://fleet.example.com"), "fleet.example.com"),
            Ok(())
        );
        let tls = site("127.0.0.1:8443", None, true);
        assert!(
            tls.check_origin(Some("http://127.0.0.1:8443"), "127.0.0.1:8443")
                .is_err()
        );
    }

    #[test]
    fn sessions_end_and_are_bounded() {
        let t0 = Instant::now();
        let mut s = Sessions::new(Duration::from_secs(60), 2);
        let a = s.open(t0);
        assert_eq!(a.len(), 64);
        assert!(s.valid(&a, t0 + Duration::from_secs(59)));
        assert!(!s.valid(&a, t0 + Duration::from_secs(60)));
        assert!(!s.valid("guess", t0));
        let b = s.open(t0 + Duration::from_secs(1));
        let c = s.open(t0 + Duration::from_secs(2));
        assert_ne!(b, c);
        assert!(!s.valid(&a, t0 + Duration::from_secs(2)), "oldest dropped");
        assert!(
            s.valid(&b, t0 + Duration::from_secs(2)) && s.valid(&c, t0 + Duration::from_secs(2))
        );
    }

    #[test]
    fn the_token_leaves_the_url() {
        assert_eq!(without_token("/", Some("token=abc")), "/");
        assert_eq!(
            without_token("/api/devices", Some("group=a&token=abc&state=idle")),
            "/api/devices?group=a&state=idle"
        );
        assert_eq!(without_token("/", None), "/");
        assert_eq!(
            without_token("//evil.example", Some("token=t")),
            "/evil.example"
        );
        assert_eq!(without_token("/\\evil.example", None), "/evil.example");
    }
}
