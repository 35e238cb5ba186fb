//! The console's HTTP side (axum): the page and its assets (embedded), the JSON API, the live
//! stream (server-sent events), `/metrics`, the request rules ([`super::guard`]: `Host`,
//! `Origin`, security headers, token and sessions) and the actions (pause, resume, abort a
//! rollout). Connections, TLS, caps and timeouts are [`super::listen`]'s.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use ed25519_dalek::SigningKey;
use kestrel_shared::issued_now;
use kestrel_shared::mqtt::BrokerConfig;
use serde::Deserialize;
use tokio::sync::watch;

use super::follow::{self, ConsoleState};
use super::guard::{Refusal, SECURITY_HEADERS, Sessions, Site, without_token};
use super::listen::{self, Counts, Over, Peer, RefusalLog};
use super::view::{DeviceFilter, FleetView, Page};
use super::{ConsoleError, Limits, Options, metrics};
use crate::Conn;
use crate::rollout::command::{Action, Command};
use crate::rollout::driver::command_topic;

const INDEX: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");
/// The cookie that carries a browser's session id (never the token).
const COOKIE: &str = "kestrel_session";
/// Sessions held at once, at most (the oldest ends first).
const MAX_SESSIONS: usize = 10_000;
/// Changes are pushed at most this often (a fleet's statuses arrive in bursts).
const PUSH_EVERY: Duration = Duration::from_millis(500);

struct App {
    shared: Arc<ConsoleState>,
    broker: BrokerConfig,
    token: Option<String>,
    actions: Option<SigningKey>,
    /// Who signs commands, as named in them: `console@ADDR`.
    by: String,
    site: Site,
    tls: bool,
    sessions: Mutex<Sessions>,
    limits: Limits,
    /// Open live streams.
    streams: Arc<Mutex<Counts>>,
    refusals: Arc<RefusalLog>,
    per_device_metrics_max: usize,
}

type AppState = State<Arc<App>>;

/// Serves the console on `opts.listen`; `ready` gets its URL (`http://` or `https://`, the
/// bound port) once it listens.
pub async fn run(opts: Options, ready: impl FnOnce(&str)) -> Result<(), ConsoleError> {
    let tls = match &opts.tls {
        Some(t) => Some(listen::tls_acceptor(&t.cert, &t.key)?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| ConsoleError::Listen {
            addr: opts.listen,
            source: e,
        })?;
    let addr = listener.local_addr().map_err(|e| ConsoleError::Listen {
        addr: opts.listen,
        source: e,
    })?;
    let site =
        Site::new(addr, opts.public_url.as_deref(), tls.is_some()).map_err(ConsoleError::Config)?;
    let (changed, _) = watch::channel(0);
    let shared = Arc::new(ConsoleState {
        view: Mutex::new(FleetView::new(&opts.broker.prefix)),
        connected: AtomicBool::new(false),
        changed,
    });
    follow::start(opts.broker.clone(), shared.clone());
    let refusals = Arc::new(RefusalLog::new());
    let app = Arc::new(App {
        shared,
        broker: opts.broker,
        token: opts.token,
        actions: opts.actions,
        by: format!("console@{addr}"),
        site,
        tls: tls.is_some(),
        sessions: Mutex::new(Sessions::new(opts.limits.session_ttl, MAX_SESSIONS)),
        limits: opts.limits.clone(),
        per_device_metrics_max: opts.per_device_metrics_max,
        streams: Arc::default(),
        refusals: refusals.clone(),
    });
    let scheme = if tls.is_some() { "https" } else { "http" };
    ready(&format!("{scheme}://{addr}/"));
    listen::serve(listener, tls, router(app), opts.limits, refusals).await;
    Ok(())
}

fn router(app: Arc<App>) -> Router {
    let asset = |ty: &'static str, body: &'static str| {
        move || async move { ([(header::CONTENT_TYPE, ty)], body) }
    };
    Router::new()
        .route("/", get(asset("text/html; charset=utf-8", INDEX)))
        .route(
            "/app.js",
            get(asset("text/javascript; charset=utf-8", APP_JS)),
        )
        .route("/app.css", get(asset("text/css; charset=utf-8", APP_CSS)))
        .route("/api/info", get(info))
        .route("/api/devices", get(devices))
        .route("/api/devices/:id", get(device))
        .route("/api/rollouts", get(rollouts))
        .route("/api/rollouts/:name", get(rollout))
        .route("/api/rollouts/:name/:action", post(act))
        .route("/api/events", get(events))
        .route("/api/stream", get(stream))
        .route("/metrics", get(prometheus))
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .layer(middleware::from_fn_with_state(app.clone(), addressed))
        .layer(middleware::from_fn_with_state(app.clone(), headers))
        .with_state(app)
}

/// The security headers, on every response (refusals included); HSTS under TLS.
async fn headers(State(app): AppState, req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    for (name, value) in SECURITY_HEADERS {
        h.insert(name, HeaderValue::from_static(value));
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if app.tls {
        h.insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        );
    }
    r
}

/// Answers only requests addressed to this console (`Host`), and state changes only from its
/// own page (`Origin`): 421 and 403 otherwise.
async fn addressed(State(app): AppState, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok());
    if let Err(e) = app.site.check_host(host) {
        return refuse(&app, &req, StatusCode::MISDIRECTED_REQUEST, e);
    }
    let changes = !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or("(not text)"));
    if changes && let Err(e) = app.site.check_origin(origin, host.unwrap_or_default()) {
        return refuse(&app, &req, StatusCode::FORBIDDEN, e);
    }
    next.run(req).await
}

fn refuse(app: &App, req: &Request, status: StatusCode, why: Refusal) -> Response {
    let peer = client(req);
    let line = format!("{why}");
    app.refusals.note(
        match why {
            Refusal::ForeignHost(_) | Refusal::NoHost => "foreign Host",
            Refusal::ForeignOrigin(_) => "foreign Origin",
        },
        || {
            format!(
                "{} {} from {peer:?}: {line}",
                req.method(),
                req.uri().path()
            )
        },
    );
    (status, format!("{why}\n")).into_response()
}

fn client(req: &Request) -> Option<SocketAddr> {
    req.extensions().get::<Peer>().map(|p| p.0)
}

/// The token from `Authorization: Bearer`, or the session id from the cookie.
fn presented(req: &Request) -> (Option<&str>, Option<&str>) {
    let h = req.headers();
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let session = h
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='));
    (bearer, session)
}

/// The `token` query parameter, decoded.
fn query_token(req: &Request) -> Option<String> {
    req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("token="))
            .map(|t| {
                percent_encoding::percent_decode_str(t)
                    .decode_utf8_lossy()
                    .into_owned()
            })
    })
}

/// Equal without an early exit (the time taken does not tell how much of a guess was right).
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// With a token set, every request carries it (`Authorization: Bearer`) or a live session's
/// cookie. A page opened with a valid `?token=` opens a session: its id as an HttpOnly,
/// SameSite=Strict cookie (Secure under TLS) and a redirect to the same URL without the token,
/// which so stays out of the browser's history and of the page's links. 401 otherwise.
async fn auth(State(app): AppState, req: Request, next: Next) -> Response {
    let Some(token) = &app.token else {
        return next.run(req).await;
    };
    let (bearer, session) = presented(&req);
    let now = Instant::now();
    let sessions = || app.sessions.lock().unwrap_or_else(|e| e.into_inner());
    if bearer.is_some_and(|b| same(b, token)) || session.is_some_and(|s| sessions().valid(s, now)) {
        return next.run(req).await;
    }
    if req.method() == Method::GET && query_token(&req).is_some_and(|t| same(&t, token)) {
        let id = sessions().open(now);
        let cookie = format!(
            "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{}",
            app.limits.session_ttl.as_secs(),
            if app.tls { "; Secure" } else { "" }
        );
        let to = without_token(req.uri().path(), req.uri().query());
        let mut r = Redirect::to(&to).into_response();
        r.headers_mut().insert(
            header::SET_COOKIE,
            HeaderValue::from_str(&cookie).expect("hex and ASCII"),
        );
        return r;
    }
    app.refusals.note("no valid token or session", || {
        format!(
            "{} {} from {:?}",
            req.method(),
            req.uri().path(),
            client(&req)
        )
    });
    let mut r = (
        StatusCode::UNAUTHORIZED,
        "a token is required: open /?token=TOKEN once, or send Authorization: Bearer TOKEN\n",
    )
        .into_response();
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

fn view(app: &App) -> std::sync::MutexGuard<'_, FleetView> {
    app.shared.view.lock().unwrap_or_else(|e| e.into_inner())
}

async fn info(State(app): AppState) -> Response {
    let v = view(&app);
    Json(serde_json::json!({
        "broker": app.broker.url,
        "prefix": app.broker.prefix,
        "connected": app.shared.connected.load(Ordering::Relaxed),
        "actions": app.actions.is_some(),
        "seq": v.seq(),
        "devices": v.devices(&DeviceFilter::default()).len(),
        "rollouts": v.rollouts().len(),
    }))
    .into_response()
}

/// The devices the filter accepts (`?group=&state=&version=&online=&q=`), in id order; with
/// `?offset=&limit=` a page of them. `X-Total-Count`: how many the filter accepts.
async fn devices(
    State(app): AppState,
    Query(f): Query<DeviceFilter>,
    Query(p): Query<Page>,
) -> Response {
    let v = view(&app);
    let (total, page) = v.devices_page(&f, p);
    ([("x-total-count", total.to_string())], Json(page)).into_response()
}

fn found<T: serde::Serialize>(x: Option<T>, what: &str) -> Response {
    match x {
        Some(x) => Json(x).into_response(),
        None => (StatusCode::NOT_FOUND, format!("no {what}\n")).into_response(),
    }
}

async fn device(State(app): AppState, Path(id): Path<String>) -> Response {
    found(view(&app).device_row(&id), &format!("device {id}"))
}

async fn rollouts(State(app): AppState) -> Response {
    Json(view(&app).rollouts()).into_response()
}

async fn rollout(State(app): AppState, Path(name): Path<String>) -> Response {
    found(view(&app).rollout_row(&name), &format!("rollout {name}"))
}

#[derive(Deserialize)]
struct Since {
    #[serde(default)]
    since: u64,
}

async fn events(State(app): AppState, Query(s): Query<Since>) -> Response {
    Json(view(&app).events(s.since)).into_response()
}

async fn prometheus(State(app): AppState) -> Response {
    let connected = app.shared.connected.load(Ordering::Relaxed);
    let text = metrics::render(&view(&app), connected, app.per_device_metrics_max);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The live stream: a full delta first, then what changed, at most every [`PUSH_EVERY`]; each
/// event is `delta` (JSON of [`super::view::Delta`] plus `connected`). 503 over a stream cap.
async fn stream(State(app): AppState, peer: Option<Extension<Peer>>) -> Response {
    let ip = peer.map_or(IpAddr::from([0, 0, 0, 0]), |Extension(p)| p.0.ip());
    let taken = listen::take(
        &app.streams,
        ip,
        app.limits.max_streams,
        app.limits.max_streams_per_client,
    );
    let slot = match taken {
        Ok(s) => s,
        Err(over) => {
            let why = match over {
                Over::Total => "live-stream cap (--max-streams) reached",
                Over::PerClient => "per-client live-stream cap (--max-streams-per-client) reached",
            };
            app.refusals.note(why, || format!("live stream for {ip}"));
            let mut r = (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response();
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("10"));
            return r;
        }
    };
    let rx = app.shared.changed.subscribe();
    let s = futures_util::stream::unfold(
        (app, rx, None::<u64>, slot),
        |(app, mut rx, last, slot)| async move {
            if last.is_some() {
                // A closed channel (the follower is gone) ends the stream.
                rx.changed().await.ok()?;
                tokio::time::sleep(PUSH_EVERY).await;
            }
            rx.mark_unchanged();
            let (delta, seq) = {
                let v = view(&app);
                (v.delta(last.unwrap_or(0)), v.seq())
            };
            let mut body = serde_json::to_value(&delta).expect("serializable");
            body["connected"] = app.shared.connected.load(Ordering::Relaxed).into();
            let ev = Event::default().event("delta").data(body.to_string());
            Some((Ok::<_, Infallible>(ev), (app, rx, Some(seq), slot)))
        },
    );
    Sse::new(s).keep_alive(KeepAlive::default()).into_response()
}

#[derive(Deserialize)]
struct ActionRequest {
    /// The rollout's name typed again: the confirmation.
    confirm: String,
    #[serde(default)]
    reason: String,
}

/// `POST /api/rollouts/NAME/ACTION` (`abort`, `pause` or `resume`; JSON `{"confirm": NAME,
/// "reason": ...}`): publishes a command signed with the operator key for the rollout's
/// controller. 403 without `--allow-actions`; another site's page is refused by its `Origin`
/// (and could not send the JSON body without a preflight anyway).
async fn act(
    State(app): AppState,
    Path((name, action)): Path<(String, Action)>,
    Json(req): Json<ActionRequest>,
) -> Response {
    let Some(key) = app.actions.clone() else {
        return (
            StatusCode::FORBIDDEN,
            "read-only console: start it with --allow-actions --operator-key KEY\n",
        )
            .into_response();
    };
    if req.confirm != name {
        return (
            StatusCode::BAD_REQUEST,
            format!("confirm: type the rollout's name, {name}\n"),
        )
            .into_response();
    }
    if view(&app).rollout_row(&name).is_none() {
        return (StatusCode::NOT_FOUND, format!("no rollout {name}\n")).into_response();
    }
    let cmd = Command {
        rollout: name,
        action,
        reason: if req.reason.trim().is_empty() {
            "operator request".into()
        } else {
            req.reason
        },
        by: app.by.clone(),
        issued: issued_now(),
        nonce: Command::new_nonce(),
    };
    let broker = app.broker.clone();
    let sent = tokio::task::spawn_blocking(move || publish_command(&broker, &cmd, &key)).await;
    match sent {
        Ok(Ok(topic)) => (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({ "published": topic })),
        )
            .into_response(),
        Ok(Err(e)) => (
            StatusCode::BAD_GATEWAY,
            format!("{}\n", kestrel_shared::Chain(&e)),
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

fn publish_command(
    cfg: &BrokerConfig,
    cmd: &Command,
    key: &SigningKey,
) -> Result<String, crate::FleetError> {
    let mut conn = Conn::connect(cfg, "console-action")?;
    let topic = command_topic(&conn, &cmd.rollout);
    let payload = serde_json::to_vec(&cmd.sign(key)).expect("serializable");
    conn.publish_all(vec![(topic.clone(), payload, false)], None)?;
    conn.disconnect();
    Ok(topic)
}
