use super::*;

#[test]
fn pending_lines_round_trip_and_name_their_server() {
    let p = Pending {
        uri: "http://h:5000".into(),
        op: Op::LogBatch {
            run_id: "r1".into(),
            metrics: vec![Metric {
                key: "val_loss".into(),
                value: 0.1 + 0.2,
                timestamp: 7,
                step: 3,
            }],
            params: vec![],
            tags: vec![kv("a", "b")],
        },
    };
    let text = serde_json::to_string(&p).unwrap();
    assert!(
        text.starts_with(r#"{"uri":"http://h:5000","op":"log-batch","run_id":"r1""#),
        "{text}"
    );
    let back: Pending = serde_json::from_str(&text).unwrap();
    assert_eq!(back.op, p.op);
}

#[test]
fn sync_keeps_what_it_could_not_deliver() {
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on: the first call fails and every line stays.
    for i in 0..3 {
        append_pending(
            dir.path(),
            &Pending {
                uri: "http://127.0.0.1:9".into(),
                op: Op::EndRun {
                    run_id: format!("r{i}"),
                    status: "FINISHED".into(),
                    end_ms: 1,
                },
            },
        )
        .unwrap();
    }
    let e = sync(dir.path(), None).unwrap_err();
    assert!(e.transient(), "{e}");
    let left = std::fs::read_to_string(dir.path().join(PENDING_FILE)).unwrap();
    assert_eq!(left.lines().count(), 3);
    assert!(sync(tempfile::tempdir().unwrap().path(), None).unwrap() == 0);
}

#[test]
fn server_failures_and_throttling_are_transient_but_refusals_are_not() {
    let api = |status| TrackError::Api {
        what: "mlflow/runs/get".into(),
        status,
        code: "RESOURCE_DOES_NOT_EXIST".into(),
        message: String::new(),
    };
    for status in [500, 503, 429] {
        assert!(api(status).transient(), "{status}");
    }
    for status in [400, 401, 404] {
        assert!(!api(status).transient(), "{status}");
    }
    assert!(TrackError::unreachable("http://h:5000", "connection refused").transient());
    assert!(!TrackError::Unsupported("s3".into()).transient());
    assert_eq!(api(404).code(), Some("RESOURCE_DOES_NOT_EXIST"));
    assert_eq!(TrackError::Unsupported("s3".into()).code(), None);
}

#[test]
fn retries_wait_out_transient_errors_only_and_at_most_once_per_wait() {
    let waits = [Duration::ZERO; 2];
    let down = || TrackError::unreachable("http://h:5000", "down");
    let mut calls = 0;
    let r = with_retries(&waits, || {
        calls += 1;
        if calls < 2 { Err(down()) } else { Ok(calls) }
    });
    assert_eq!(r.unwrap(), 2);
    let mut calls = 0;
    let r: Result<(), _> = with_retries(&waits, || {
        calls += 1;
        Err(down())
    });
    assert!(matches!(r, Err(TrackError::Unreachable { .. })));
    assert_eq!(calls, 3);
    let mut calls = 0;
    let r: Result<(), _> = with_retries(&waits, || {
        calls += 1;
        Err(TrackError::Unsupported("no".into()))
    });
    assert!(matches!(r, Err(TrackError::Unsupported(_))));
    assert_eq!(calls, 1);
}
