//! The console's HTTP side (axum): the page and its assets (embedded), the JSON API, the live
//! stream (server-sent events), `/metrics`, the token check and the actions (abort, pause,
//! resume a rollout).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ed25519_dalek::SigningKey;
use futures_util::Stream;
use kestrel_shared::issued_now;
use kestrel_shared::mqtt::BrokerConfig;
use serde::Deserialize;
use tokio::sync::watch;

use super::follow::{self, Shared};
use super::view::{DeviceFilter, FleetView};
use super::{ConsoleError, Options, metrics};
use crate::Conn;
use crate::rollout::command::{Action, Command};
use crate::rollout::driver::command_topic;

const INDEX: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");
/// The cookie that carries the token after the page was opened with `?token=`.
const COOKIE: &str = "kestrel_console";
/// Changes are pushed at most this often (a fleet's statuses arrive in bursts).
const PUSH_EVERY: Duration = Duration::from_millis(500);

struct App {
    shared: Arc<Shared>,
    broker: BrokerConfig,
    token: Option<String>,
    actions: Option<SigningKey>,
    /// Who signs commands, as named in them: `console@ADDR`.
    by: String,
}

type AppState = State<Arc<App>>;

pub async fn run(opts: Options, ready: impl FnOnce(SocketAddr)) -> Result<(), ConsoleError> {
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| ConsoleError::Listen {
            addr: opts.listen,
            reason: e.to_string(),
        })?;
    let addr = listener.local_addr().map_err(|e| ConsoleError::Listen {
        addr: opts.listen,
        reason: e.to_string(),
    })?;
    let (changed, _) = watch::channel(0);
    let shared = Arc::new(Shared {
        view: Mutex::new(FleetView::new(&opts.broker.prefix)),
        connected: AtomicBool::new(false),
        changed,
    });
    follow::start(opts.broker.clone(), shared.clone());
    let app = Arc::new(App {
        shared,
        broker: opts.broker,
        token: opts.token,
        actions: opts.actions,
        by: format!("console@{addr}"),
    });
    ready(addr);
    axum::serve(listener, router(app))
        .await
        .map_err(|e| ConsoleError::Runtime(e.to_string()))
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
        .with_state(app)
}

/// The token, from the Authorization header, the cookie or the `token` query parameter.
fn presented(req: &Request) -> Option<String> {
    let h = req.headers();
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let cookie = h
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            c.trim()
                .strip_prefix(&format!("{COOKIE}="))
                .map(String::from)
        });
    let query = req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("token="))
            .map(|t| {
                percent_encoding::percent_decode_str(t)
                    .decode_utf8_lossy()
                    .into_owned()
            })
    });
    bearer.map(String::from).or(cookie).or(query)
}

/// Equal without an early exit (the time taken does not tell how much of a guess was right).
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Every request carries the token when one is set (401 otherwise); a page opened with a
/// valid `?token=` gets it as an HttpOnly cookie, so its own requests carry it.
async fn auth(State(app): AppState, req: Request, next: Next) -> Response {
    let Some(token) = &app.token else {
        return next.run(req).await;
    };
    let given = presented(&req);
    if !given.as_deref().is_some_and(|g| same(g, token)) {
        let mut r = (
            StatusCode::UNAUTHORIZED,
            "a token is required: open /?token=TOKEN or send Authorization: Bearer TOKEN\n",
        )
            .into_response();
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    let mut r = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&format!(
        "{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
    )) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
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

async fn devices(State(app): AppState, Query(f): Query<DeviceFilter>) -> Response {
    Json(view(&app).devices(&f)).into_response()
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
    let text = metrics::render(&view(&app), connected);
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
/// event is `delta` (JSON of [`super::view::Delta`] plus `connected`).
async fn stream(State(app): AppState) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let rx = app.shared.changed.subscribe();
    let s =
        futures_util::stream::unfold((app, rx, None::<u64>), |(app, mut rx, last)| async move {
            if let Some(_since) = last {
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
            Some((Ok(ev), (app, rx, Some(seq))))
        });
    Sse::new(s).keep_alive(KeepAlive::default())
}

#[derive(Deserialize)]
struct ActionRequest {
    /// The rollout's name typed again: the confirmation.
    confirm: String,
    #[serde(default)]
    reason: String,
}

/// `POST /api/rollouts/NAME/ACTION` (`abort`, `pause` or `resume`; JSON `{"confirm": NAME,
/// "reason": ...}`): publishes a signed command for the rollout's controller. 403 without
/// `--allow-actions`; the JSON body (a non-simple request) keeps other sites' pages from posting
/// it.
async fn act(
    State(app): AppState,
    Path((name, action)): Path<(String, Action)>,
    Json(req): Json<ActionRequest>,
) -> Response {
    let Some(key) = app.actions.clone() else {
        return (
            StatusCode::FORBIDDEN,
            "read-only console: start it with --allow-actions --key KEY\n",
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
        Ok(Err(e)) => (StatusCode::BAD_GATEWAY, format!("{e}\n")).into_response(),
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
