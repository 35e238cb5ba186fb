//! Broker connection settings shared by the agent, the publisher and the rollout controller:
//! `mqtt://host:port` or `mqtts://host:port` (TLS with rustls and the ring provider, the broker's
//! CA pinned from a PEM file), optional username/password, packet limits sized for the chunks.
//! Behind the `mqtt` feature so the rest of this crate stays free of IO dependencies.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rumqttc::{MqttOptions, TlsConfiguration, Transport};
use serde::{Deserialize, Serialize};

use crate::topics::DEFAULT_PREFIX;

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("broker URL `{0}`: expected mqtt://HOST:PORT or mqtts://HOST:PORT")]
    Url(String),
    #[error("{path}")]
    File {
        path: String,
        #[source]
        source: crate::error::Cause,
    },
    #[error("TLS: {0}")]
    Tls(String),
    #[error(
        "broker {url}: refusing to send a password over plain MQTT to a host other than this \
         machine (anyone on the path reads it): use mqtts:// with the broker's CA, or, in a lab \
         you trust, allow it with --insecure-plain-password (agent.toml: \
         `insecure_plain_password = true` in [broker])"
    )]
    PlainPassword { url: String },
    #[error("TLS: {context}")]
    Rustls {
        context: String,
        #[source]
        source: rustls::Error,
    },
}

fn default_prefix() -> String {
    DEFAULT_PREFIX.to_string()
}
fn default_keep_alive() -> u64 {
    30
}
/// The largest message payload a Kestrel fleet's broker forwards: the shipped Mosquitto config's
/// `message_size_limit` and `kestrel-broker --max-payload-bytes` (both refuse a larger message from
/// its publisher, so it never reaches a device). Clients accept any packet such a broker sends
/// ([`DEFAULT_MAX_PACKET_BYTES`]): an oversized message never costs a device its connection.
pub const MAX_PAYLOAD_BYTES: usize = 2 << 20;
/// A client's packet limit by default: the broker's payload limit plus the topic and headers.
pub const DEFAULT_MAX_PACKET_BYTES: usize = MAX_PAYLOAD_BYTES + 8192;

fn default_max_packet() -> usize {
    DEFAULT_MAX_PACKET_BYTES
}

/// How to reach the broker (the `[broker]` table of `agent.toml`, and the trainer's flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    /// `mqtt://HOST:PORT` (plain TCP) or `mqtts://HOST:PORT` (TLS; needs `ca_file`).
    pub url: String,
    /// Topic prefix.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    #[serde(default)]
    pub username: Option<String>,
    /// File holding the password (first line). Without it, a systemd credential named
    /// `broker-password` (`LoadCredential=broker-password:…` in the unit) is used when present.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// PEM file with the CA certificate(s) the broker's certificate must chain to.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Also trust the system's root certificates (`/etc/ssl/certs`), for brokers with a public
    /// certificate (AWS IoT Core, HiveMQ Cloud, EMQX Cloud).
    #[serde(default)]
    pub system_roots: bool,
    /// PEM file with this client's certificate (chain), for brokers that authenticate devices
    /// by certificate (Mosquitto's `require_certificate`, AWS IoT Core); needs `key_file`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM file with the private key of `cert_file` (PKCS#8, PKCS#1 or SEC1).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    #[serde(default = "default_keep_alive")]
    pub keep_alive_s: u64,
    /// Largest MQTT packet sent or accepted; must exceed the chunk size, and the broker's payload
    /// limit (a larger packet from the broker ends the connection).
    #[serde(default = "default_max_packet")]
    pub max_packet_bytes: usize,
    /// Send the password over plain `mqtt://` to a host other than this machine (a lab's
    /// broker): refused unless set, since anyone on the path reads it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure_plain_password: bool,
}

/// The systemd credential `broker-password` of this service, if it has one
/// (`$CREDENTIALS_DIRECTORY/broker-password`, readable only by the service).
fn credential() -> Option<PathBuf> {
    let p = Path::new(&std::env::var_os("CREDENTIALS_DIRECTORY")?).join("broker-password");
    p.is_file().then_some(p)
}

/// Whether `host` (a URL's host) names this machine: `localhost`, 127.0.0.0/8 or ::1.
fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Turns off Nagle's algorithm on a client's socket. Kestrel's messages are small requests and
/// replies whose latency matters: with Nagle a small write waits for the acknowledgement of the
/// previous one, which the peer may delay up to 40 ms. (Measured: the ORT agent's round trip on
/// the embedded broker, 93 requests/s with Nagle.)
pub fn no_delay(eventloop: &mut rumqttc::EventLoop) {
    let mut n = eventloop.network_options();
    n.set_tcp_nodelay(true);
    eventloop.set_network_options(n);
}

impl BrokerConfig {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            prefix: default_prefix(),
            username: None,
            password_file: None,
            ca_file: None,
            system_roots: false,
            cert_file: None,
            key_file: None,
            keep_alive_s: default_keep_alive(),
            max_packet_bytes: default_max_packet(),
            insecure_plain_password: false,
        }
    }

    /// Resolves relative file paths against `base` (the config file's directory).
    pub fn resolve(&mut self, base: &Path) {
        let files = [
            &mut self.password_file,
            &mut self.ca_file,
            &mut self.cert_file,
            &mut self.key_file,
        ];
        for p in files.into_iter().flatten() {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
    }

    /// (TLS?, host, port) of the URL.
    pub fn endpoint(&self) -> Result<(bool, String, u16), BrokerError> {
        let bad = || BrokerError::Url(self.url.clone());
        let (tls, rest) = if let Some(r) = self.url.strip_prefix("mqtts://") {
            (true, r)
        } else if let Some(r) = self.url.strip_prefix("mqtt://") {
            (false, r)
        } else if self.url.contains("://") {
            return Err(bad());
        } else {
            (false, self.url.as_str())
        };
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().map_err(|_| bad())?),
            None => (rest, if tls { 8883 } else { 1883 }),
        };
        if host.is_empty() || host.contains('/') {
            return Err(bad());
        }
        Ok((tls, host.to_string(), port))
    }

    /// Connection options for `client_id`; `clean_session = false` keeps the broker-side session
    /// (subscriptions and QoS 1 messages queued while offline).
    pub fn options(
        &self,
        client_id: &str,
        clean_session: bool,
    ) -> Result<MqttOptions, BrokerError> {
        let (tls, host, port) = self.endpoint()?;
        let local = is_loopback(&host);
        let mut o = MqttOptions::new(client_id, host, port);
        o.set_keep_alive(Duration::from_secs(self.keep_alive_s.max(5)))
            .set_max_packet_size(self.max_packet_bytes, self.max_packet_bytes)
            .set_clean_session(clean_session)
            .set_inflight(64);
        if let Some(user) = &self.username {
            let file = self.password_file.clone().or_else(credential);
            if file.is_some() && !tls && !local && !self.insecure_plain_password {
                return Err(BrokerError::PlainPassword {
                    url: self.url.clone(),
                });
            }
            let password = match file {
                Some(p) => std::fs::read_to_string(&p)
                    .map_err(|e| file_error(&p, e))?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
                None => String::new(),
            };
            o.set_credentials(user.clone(), password);
        }
        if tls {
            o.set_transport(Transport::tls_with_config(self.tls_config()?));
        }
        Ok(o)
    }

    fn tls_config(&self) -> Result<TlsConfiguration, BrokerError> {
        let mut roots = rustls::RootCertStore::empty();
        if let Some(ca) = &self.ca_file {
            for cert in certificates(ca)? {
                roots.add(cert).map_err(|e| file_error(ca, e))?;
            }
        }
        if self.system_roots {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found.errors.first().map(|e| format!(": {e}"));
                return Err(BrokerError::Tls(format!(
                    "system_roots: no root certificate found on this system{}",
                    why.unwrap_or_default()
                )));
            }
        }
        if roots.is_empty() {
            return Err(BrokerError::Tls(format!(
                "{}: mqtts:// needs ca_file (the broker's CA, PEM) or system_roots = true",
                self.url
            )));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|source| BrokerError::Rustls {
                context: "protocol versions".into(),
                source,
            })?
            .with_root_certificates(roots);
        let config = match (&self.cert_file, &self.key_file) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                use rustls::pki_types::PrivateKeyDer;
                use rustls::pki_types::pem::PemObject;
                let chain = certificates(cert)?;
                let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| file_error(key, e))?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .map_err(|source| BrokerError::Rustls {
                        context: key.display().to_string(),
                        source,
                    })?
            }
            _ => {
                return Err(BrokerError::Tls(
                    "a client certificate needs both cert_file and key_file".into(),
                ));
            }
        };
        Ok(TlsConfiguration::Rustls(Arc::new(config)))
    }
}

fn file_error(path: &Path, e: impl Into<crate::error::Cause>) -> BrokerError {
    BrokerError::File {
        path: path.display().to_string(),
        source: e.into(),
    }
}

/// The certificates of a PEM file (at least one).
fn certificates(
    path: &Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, BrokerError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if certs.is_empty() {
        return Err(file_error(path, "no certificate found"));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let e = |u: &str| BrokerConfig::new(u).endpoint();
        assert_eq!(
            e("mqtt://127.0.0.1:1884").unwrap(),
            (false, "127.0.0.1".into(), 1884)
        );
        assert_eq!(
            e("mqtts://broker.lan").unwrap(),
            (true, "broker.lan".into(), 8883)
        );
        assert_eq!(
            e("localhost:1883").unwrap(),
            (false, "localhost".into(), 1883)
        );
        assert!(e("http://x:1").is_err());
        assert!(e("mqtt://x:port").is_err());
        assert!(e("mqtt://:1883").is_err());
        let err = BrokerConfig::new("mqtts://x:8883")
            .options("c", true)
            .unwrap_err();
        assert!(err.to_string().contains("ca_file"), "{err}");
    }

    /// A password goes over plain MQTT only to this machine, or when the lab flag says so; the
    /// refusal names the URL and the flag.
    #[test]
    fn passwords_cross_plain_mqtt_only_to_loopback() {
        let dir = std::env::temp_dir().join(format!("kestrel-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pw = dir.join("pw");
        std::fs::write(&pw, "secret\n").unwrap();
        let cfg = |url: &str| {
            let mut c = BrokerConfig::new(url);
            c.username = Some("u".into());
            c.password_file = Some(pw.clone());
            c
        };
        for url in [
            "mqtt://127.0.0.1:1883",
            "mqtt://127.8.9.1:1",
            "localhost:1883",
            "mqtt://[::1]:1883",
        ] {
            assert!(cfg(url).options("c", true).is_ok(), "{url}");
        }
        for url in [
            "mqtt://192.168.1.10:1883",
            "mqtt://broker.lan",
            "10.0.0.2:1883",
            "mqtt://[fe80::1]:1883",
        ] {
            let e = cfg(url).options("c", true).unwrap_err().to_string();
            assert!(
                e.contains(url) && e.contains("--insecure-plain-password"),
                "{e}"
            );
            let mut lab = cfg(url);
            lab.insecure_plain_password = true;
            assert!(lab.options("c", true).is_ok(), "{url}");
        }
        // A user name alone (no password) is no secret.
        let mut c = BrokerConfig::new("mqtt://192.168.1.10:1883");
        c.username = Some("u".into());
        assert!(c.options("c", true).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file without a certificate, or half a client identity, is an error naming what.
    #[test]
    fn tls_files_are_checked() {
        let dir = std::env::temp_dir().join(format!("kestrel-mqtt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let mut c = BrokerConfig::new("mqtts://x:8883");
        c.ca_file = Some(junk.clone());
        let err = crate::chain(&c.options("c", true).unwrap_err());
        assert!(err.contains("junk.pem: no certificate found"), "{err}");
        c.ca_file = None;
        c.system_roots = true;
        c.cert_file = Some(junk);
        match c.options("c", true) {
            // A system with root certificates gets as far as the half identity.
            Err(e) => assert!(
                e.to_string().contains("cert_file and key_file")
                    || e.to_string().contains("no root certificate"),
                "{e}"
            ),
            Ok(_) => panic!("a certificate without its key is refused"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
