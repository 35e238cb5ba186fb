use super::*;

const MB: u64 = 1 << 20;

fn offer(version: u64, chunks: u32) -> Offer {
    Offer {
        version,
        chunks,
        total_bytes: chunks as u64 * 1000,
        rollback: false,
        held: vec![],
    }
}

/// Drives a full successful install of `version` and returns the actions of each step.
fn install(u: &mut Updater, version: u64, chunks: u32) -> Vec<Vec<Action>> {
    let mut steps = vec![u.handle(Event::Offered(offer(version, chunks)))];
    for i in 0..chunks {
        steps.push(u.handle(Event::ChunkStored { version, index: i }));
    }
    steps.push(u.handle(Event::Verified { version }));
    steps.push(u.handle(Event::Staged { version }));
    steps.push(u.handle(Event::HealthPassed { version }));
    steps.push(u.handle(Event::Activated { version }));
    steps
}

/// Offers `version` in one chunk and takes it through storing, verification and staging (the
/// health check is next).
fn stage(u: &mut Updater, version: u64) {
    u.handle(Event::Offered(offer(version, 1)));
    u.handle(Event::ChunkStored { version, index: 0 });
    u.handle(Event::Verified { version });
    u.handle(Event::Staged { version });
}

#[test]
fn happy_path_then_upgrade_keeps_previous() {
    let mut u = Updater::new(MB);
    let s = install(&mut u, 1, 3);
    assert_eq!(
        s[0],
        vec![
            Action::Fetch {
                version: 1,
                chunks: vec![0, 1, 2]
            },
            Action::Report(Report::Downloading { version: 1 })
        ]
    );
    assert_eq!(s[1], vec![]);
    assert_eq!(s[3], vec![Action::Verify { version: 1 }]);
    assert_eq!(s[4], vec![Action::Stage { version: 1 }]);
    assert_eq!(s[5], vec![Action::HealthCheck { version: 1 }]);
    assert_eq!(s[6], vec![Action::Activate { version: 1 }]);
    assert_eq!(
        s[7],
        vec![Action::Report(Report::Active {
            version: 1,
            previous: None
        })]
    );
    install(&mut u, 2, 1);
    assert_eq!(
        (u.active, u.previous, &u.phase),
        (Some(2), Some(1), &Phase::Idle)
    );
}

#[test]
fn redelivery_and_duplicates_are_ignored() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 2);
    assert_eq!(u.handle(Event::Offered(offer(1, 2))), vec![]); // already active
    u.handle(Event::Offered(offer(2, 2)));
    assert_eq!(u.handle(Event::Offered(offer(2, 2))), vec![]); // in progress
    assert_eq!(
        u.handle(Event::ChunkStored {
            version: 2,
            index: 0
        }),
        vec![]
    );
    assert_eq!(
        u.handle(Event::ChunkStored {
            version: 2,
            index: 0
        }),
        vec![]
    ); // duplicate chunk
    assert_eq!(
        u.handle(Event::ChunkStored {
            version: 2,
            index: 7
        }),
        vec![]
    ); // out of range
    assert_eq!(
        u.handle(Event::ChunkStored {
            version: 2,
            index: 1
        }),
        vec![Action::Verify { version: 2 }]
    );
}

#[test]
fn rejections_keep_the_active_model() {
    let mut u = Updater::new(10_000);
    install(&mut u, 5, 1);
    // Downgrade without --rollback.
    let a = u.handle(Event::Offered(offer(4, 1)));
    assert!(
        matches!(&a[..], [Action::Report(Report::Rejected { version: 4, reason })] if reason.contains("--rollback")),
        "{a:?}"
    );
    // With --rollback it proceeds.
    let a = u.handle(Event::Offered(Offer {
        rollback: true,
        ..offer(4, 1)
    }));
    assert!(matches!(a[0], Action::Fetch { version: 4, .. }));
    // Over the size limit (supersedes the rollback in progress).
    let a = u.handle(Event::Offered(Offer {
        total_bytes: 20_000,
        ..offer(6, 2)
    }));
    assert_eq!(a[0], Action::Discard { version: 4 });
    assert!(
        matches!(&a[1], Action::Report(Report::Rejected { version: 6, reason }) if reason.contains("over the limit"))
    );
    // Empty offer.
    let a = u.handle(Event::Offered(offer(7, 0)));
    assert!(matches!(
        &a[..],
        [Action::Report(Report::Rejected { version: 7, .. })]
    ));
    assert_eq!((u.active, &u.phase), (Some(5), &Phase::Idle));
    assert!(u.last_error.is_some());
}

/// Garbage on a chunk topic never fails the version: each corrupt chunk is dropped and asked
/// for again (at once up to the bound, then only when the download stalls), and the good chunk
/// completes the download.
#[test]
fn corrupt_chunks_are_refetched_never_rejected() {
    let mut u = Updater::new(MB);
    u.handle(Event::Offered(offer(1, 4)));
    for n in 1..=MAX_CORRUPT_REFETCHES + 20 {
        let a = u.handle(Event::ChunkCorrupt {
            version: 1,
            index: 2,
        });
        let refetch = vec![Action::Fetch {
            version: 1,
            chunks: vec![2],
        }];
        assert_eq!(
            a,
            if n <= MAX_CORRUPT_REFETCHES {
                refetch
            } else {
                vec![]
            },
            "{n}"
        );
        assert!(matches!(u.phase, Phase::Downloading { .. }), "{n}");
    }
    assert_eq!(u.last_failed, None);
    assert!(
        u.last_error
            .as_deref()
            .unwrap()
            .contains("chunk 2 of v1 failed its sha256 check")
    );
    for index in 0..4 {
        u.handle(Event::ChunkStored { version: 1, index });
    }
    assert_eq!(u.phase, Phase::Verifying { version: 1 });
}

#[test]
fn failed_verification_is_rejected() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    u.handle(Event::Offered(offer(2, 1)));
    u.handle(Event::ChunkStored {
        version: 2,
        index: 0,
    });
    let a = u.handle(Event::VerifyFailed {
        version: 2,
        reason: "model.onnx: sha256 mismatch".into(),
    });
    assert_eq!(a[0], Action::Discard { version: 2 });
    assert!(
        matches!(&a[1], Action::Report(Report::Rejected { version: 2, reason }) if reason.contains("sha256"))
    );
    assert_eq!(u.active, Some(1));
}

#[test]
fn failed_health_check_rolls_back() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    stage(&mut u, 2);
    let a = u.handle(Event::HealthFailed {
        version: 2,
        reason: "golden/0.png: top-1 1 (expected 0)".into(),
    });
    assert_eq!(a[0], Action::Discard { version: 2 });
    assert!(matches!(
        &a[1],
        Action::Report(Report::RolledBack {
            version: 2,
            active: Some(1),
            ..
        })
    ));
    assert_eq!(
        (u.active, u.previous, &u.phase),
        (Some(1), None, &Phase::Idle)
    );
}

#[test]
fn stale_events_change_nothing() {
    let mut u = Updater::new(MB);
    u.handle(Event::Offered(offer(1, 1)));
    let before = u.clone();
    for ev in [
        Event::Verified { version: 1 },
        Event::Staged { version: 1 },
        Event::HealthPassed { version: 1 },
        Event::Activated { version: 1 },
        Event::HealthFailed {
            version: 1,
            reason: String::new(),
        },
        Event::ChunkStored {
            version: 9,
            index: 0,
        },
        Event::ChunkCorrupt {
            version: 9,
            index: 0,
        },
    ] {
        assert_eq!(u.handle(ev.clone()), vec![], "{ev:?}");
        assert_eq!(u, before, "{ev:?}");
    }
}

#[test]
fn resume_continues_from_every_phase() {
    let mut u = Updater::new(MB);
    u.handle(Event::Offered(offer(1, 3)));
    u.handle(Event::ChunkStored {
        version: 1,
        index: 1,
    });
    // Journal round trip, as the IO layer does after every event.
    let mut j: Updater = serde_json::from_str(&serde_json::to_string(&u).unwrap()).unwrap();
    assert_eq!(
        j.resume(),
        vec![Action::Fetch {
            version: 1,
            chunks: vec![0, 2]
        }]
    );
    for i in [0, 2] {
        j.handle(Event::ChunkStored {
            version: 1,
            index: i,
        });
    }
    assert_eq!(j.resume(), vec![Action::Verify { version: 1 }]);
    j.handle(Event::Verified { version: 1 });
    assert_eq!(j.resume(), vec![Action::Verify { version: 1 }]); // staged files are re-verified
    assert_eq!(j.phase, Phase::Verifying { version: 1 });
    j.handle(Event::Verified { version: 1 });
    j.handle(Event::Staged { version: 1 });
    j.handle(Event::HealthPassed { version: 1 });
    assert_eq!(j.resume(), vec![Action::Activate { version: 1 }]); // the swap is idempotent
    j.handle(Event::Activated { version: 1 });
    assert_eq!(j.resume(), vec![]);
    assert_eq!(j.active, Some(1));
}

#[test]
fn back_to_the_active_version_mid_update_cancels_without_download() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 2);
    u.handle(Event::Offered(offer(2, 3)));
    assert_eq!(
        u.handle(Event::Offered(offer(1, 2))),
        vec![Action::Discard { version: 2 }]
    );
    assert_eq!((u.active, &u.phase), (Some(1), &Phase::Idle));
}

#[test]
fn refusals_are_reported_and_keep_the_active_model() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 2);
    let a = u.handle(Event::Refused {
        version: 5,
        reason: "manifest signed by unknown key abc".into(),
    });
    assert_eq!(
        a,
        vec![Action::Report(Report::Rejected {
            version: 5,
            reason: "manifest signed by unknown key abc".into()
        })]
    );
    assert_eq!((u.active, &u.phase), (Some(1), &Phase::Idle));
    assert_eq!(
        u.last_error.as_deref(),
        Some("manifest signed by unknown key abc")
    );
}

/// A shadow goes through every step of an update and ends running beside the active model:
/// no atomic activation, and the same corrupt-chunk limit, refusals and resume.
#[test]
fn a_shadow_takes_every_step_but_runs_beside() {
    let mut u = Updater::shadow(MB);
    let s = install(&mut u, 7, 2);
    assert_eq!(s[2], vec![Action::Verify { version: 7 }]);
    assert_eq!(s[3], vec![Action::Stage { version: 7 }]);
    assert_eq!(s[4], vec![Action::HealthCheck { version: 7 }]);
    assert_eq!(
        s[5],
        vec![
            Action::RunBeside { version: 7 },
            Action::Report(Report::Active {
                version: 7,
                previous: None
            })
        ]
    );
    assert_eq!(s[6], vec![], "no activation to confirm");
    assert_eq!((u.active, &u.phase), (Some(7), &Phase::Idle));
    // The journaled state survives a round trip and a running shadow resumes with nothing to do.
    let back: Updater = serde_json::from_str(&serde_json::to_string(&u).unwrap()).unwrap();
    assert_eq!(back, u);
    assert_eq!(u.clone().resume(), vec![]);

    // Corrupt chunks: dropped and asked for again, never a failure, as for an update.
    let mut u = Updater::shadow(MB);
    u.handle(Event::Offered(offer(8, 2)));
    for n in 1..=MAX_CORRUPT_REFETCHES + 2 {
        let a = u.handle(Event::ChunkCorrupt {
            version: 8,
            index: 1,
        });
        assert_eq!(a.is_empty(), n > MAX_CORRUPT_REFETCHES, "{n}");
    }
    assert!(matches!(u.phase, Phase::Downloading { .. }));
    // Too large, and a download cut short resumes with the missing chunks only.
    let mut u = Updater::shadow(1000);
    let a = u.handle(Event::Offered(offer(9, 2)));
    assert!(
        matches!(&a[..], [Action::Report(Report::Rejected { .. })]),
        "{a:?}"
    );
    let mut u = Updater::shadow(MB);
    u.handle(Event::Offered(offer(9, 3)));
    u.handle(Event::ChunkStored {
        version: 9,
        index: 1,
    });
    assert_eq!(
        u.resume(),
        vec![Action::Fetch {
            version: 9,
            chunks: vec![0, 2]
        }]
    );
    // A journal written before roles existed reads as an update's.
    let old = r#"{"active":3,"previous":null,"phase":"Idle","last_error":null,"max_bytes":10}"#;
    assert_eq!(
        serde_json::from_str::<Updater>(old).unwrap().role,
        Role::Install
    );
}

#[test]
fn held_chunks_are_not_fetched_and_a_fully_held_offer_goes_to_verification() {
    let mut u = Updater::new(MB);
    let a = u.handle(Event::Offered(Offer {
        held: vec![0, 2],
        ..offer(1, 4)
    }));
    assert_eq!(
        a[0],
        Action::Fetch {
            version: 1,
            chunks: vec![1, 3]
        }
    );
    assert!(
        u.handle(Event::ChunkStored {
            version: 1,
            index: 1
        })
        .is_empty()
    );
    let a = u.handle(Event::ChunkStored {
        version: 1,
        index: 3,
    });
    assert_eq!(a, vec![Action::Verify { version: 1 }]);
    // Every piece held: nothing to fetch.
    let mut u = Updater::new(MB);
    let a = u.handle(Event::Offered(Offer {
        held: vec![0, 1],
        ..offer(2, 2)
    }));
    assert_eq!(
        a,
        vec![
            Action::Report(Report::Downloading { version: 2 }),
            Action::Verify { version: 2 }
        ]
    );
    assert_eq!(u.phase, Phase::Verifying { version: 2 });
}

#[test]
fn a_damaged_active_version_is_installed_again_and_keeps_its_previous() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    install(&mut u, 2, 1);
    assert_eq!((u.active, u.previous), (Some(2), Some(1)));
    let a = u.handle(Event::Damaged {
        version: 2,
        reason: "part 2 (head): its 10 bytes are not the part".into(),
    });
    assert!(a.is_empty());
    assert_eq!((u.active, u.previous), (None, Some(1)));
    assert!(u.last_error.as_deref().unwrap().contains("head"));
    let steps = install(&mut u, 2, 1);
    assert!(matches!(steps[0][0], Action::Fetch { version: 2, .. }));
    assert_eq!((u.active, u.previous), (Some(2), Some(1)));
    // Only the active version, idle, can be damaged.
    assert!(
        u.handle(Event::Damaged {
            version: 1,
            reason: String::new()
        })
        .is_empty()
    );
    assert_eq!(u.active, Some(2));
}

#[test]
fn chunks_of_a_superseded_download_do_not_count_toward_the_new_one() {
    let mut u = Updater::new(MB);
    u.handle(Event::Offered(offer(1, 2)));
    u.handle(Event::ChunkStored {
        version: 1,
        index: 0,
    });
    let a = u.handle(Event::Offered(offer(2, 2)));
    assert_eq!(a[0], Action::Discard { version: 1 });
    // A late chunk of v1 (same index range as v2's) is not one of v2's.
    assert_eq!(
        u.handle(Event::ChunkStored {
            version: 1,
            index: 1
        }),
        vec![]
    );
    assert_eq!(
        u.resume(),
        vec![Action::Fetch {
            version: 2,
            chunks: vec![0, 1]
        }],
        "v2 still lacks both of its chunks"
    );
}

#[test]
fn a_second_offer_while_verifying_discards_the_first_and_its_late_verification_is_ignored() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    u.handle(Event::Offered(offer(2, 1)));
    u.handle(Event::ChunkStored {
        version: 2,
        index: 0,
    });
    assert_eq!(u.phase, Phase::Verifying { version: 2 });
    assert_eq!(
        u.handle(Event::Offered(offer(3, 2))),
        vec![
            Action::Discard { version: 2 },
            Action::Fetch {
                version: 3,
                chunks: vec![0, 1]
            },
            Action::Report(Report::Downloading { version: 3 }),
        ]
    );
    assert_eq!(u.handle(Event::Verified { version: 2 }), vec![]);
    assert!(matches!(&u.phase, Phase::Downloading { offer, .. } if offer.version == 3));
    assert_eq!(
        (u.active, u.last_failed),
        (Some(1), None),
        "superseded is not failed"
    );
}

#[test]
fn a_downgrade_with_rollback_makes_the_version_it_leaves_the_previous() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    install(&mut u, 2, 1);
    let a = u.handle(Event::Offered(Offer {
        rollback: true,
        ..offer(1, 1)
    }));
    assert!(matches!(a[0], Action::Fetch { version: 1, .. }), "{a:?}");
    u.handle(Event::ChunkStored {
        version: 1,
        index: 0,
    });
    u.handle(Event::Verified { version: 1 });
    u.handle(Event::Staged { version: 1 });
    assert_eq!(
        u.handle(Event::HealthPassed { version: 1 }),
        vec![Action::Activate { version: 1 }]
    );
    assert_eq!(
        u.handle(Event::Activated { version: 1 }),
        vec![Action::Report(Report::Active {
            version: 1,
            previous: Some(2)
        })]
    );
    assert_eq!(
        (u.active, u.previous, &u.phase),
        (Some(1), Some(2), &Phase::Idle)
    );
}

#[test]
fn a_failed_health_check_keeps_active_and_previous_and_the_version_may_be_offered_again() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    install(&mut u, 2, 1);
    stage(&mut u, 3);
    let a = u.handle(Event::HealthFailed {
        version: 3,
        reason: "golden".into(),
    });
    assert_eq!(
        a[1],
        Action::Report(Report::RolledBack {
            version: 3,
            active: Some(2),
            reason: "health check failed: golden".into(),
        })
    );
    assert_eq!(
        (u.active, u.previous, u.last_failed),
        (Some(2), Some(1), Some(3))
    );
    // A failed version is not barred: offered again, it is fetched afresh.
    let a = u.handle(Event::Offered(offer(3, 1)));
    assert_eq!(
        a[0],
        Action::Fetch {
            version: 3,
            chunks: vec![0]
        }
    );
}

#[test]
fn resume_during_the_health_check_verifies_the_staged_files_again() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    u.handle(Event::Offered(offer(2, 2)));
    for index in 0..2 {
        u.handle(Event::ChunkStored { version: 2, index });
    }
    u.handle(Event::Verified { version: 2 });
    u.handle(Event::Staged { version: 2 });
    assert_eq!(u.phase, Phase::Checking { version: 2 });
    let mut j: Updater = serde_json::from_str(&serde_json::to_string(&u).unwrap()).unwrap();
    assert_eq!(j.resume(), vec![Action::Verify { version: 2 }]);
    assert_eq!(j.phase, Phase::Verifying { version: 2 });
    // A health result from before the restart is stale now.
    assert_eq!(j.handle(Event::HealthPassed { version: 2 }), vec![]);
    assert_eq!(
        (j.active, &j.phase),
        (Some(1), &Phase::Verifying { version: 2 })
    );
}

#[test]
fn a_refusal_discards_only_when_it_names_the_version_being_downloaded() {
    let mut u = Updater::new(MB);
    install(&mut u, 1, 1);
    u.handle(Event::Offered(offer(2, 3)));
    let a = u.handle(Event::Refused {
        version: 9,
        reason: "bad signature".into(),
    });
    assert!(
        matches!(
            &a[..],
            [Action::Report(Report::Rejected { version: 9, .. })]
        ),
        "{a:?}"
    );
    assert_eq!(u.phase.target(), Some(2), "the download of v2 goes on");
    let a = u.handle(Event::Refused {
        version: 2,
        reason: "staging v2: disk full".into(),
    });
    assert_eq!(
        a,
        vec![
            Action::Discard { version: 2 },
            Action::Report(Report::Rejected {
                version: 2,
                reason: "staging v2: disk full".into()
            }),
        ]
    );
    assert_eq!(
        (u.active, &u.phase, u.last_failed),
        (Some(1), &Phase::Idle, Some(2))
    );
}

#[test]
fn the_corrupt_chunk_refetch_budget_starts_again_with_each_download() {
    let mut u = Updater::new(MB);
    u.handle(Event::Offered(offer(1, 2)));
    for _ in 0..MAX_CORRUPT_REFETCHES {
        u.handle(Event::ChunkCorrupt {
            version: 1,
            index: 0,
        });
    }
    assert_eq!(
        u.handle(Event::ChunkCorrupt {
            version: 1,
            index: 0
        }),
        vec![],
        "v1's budget spent"
    );
    u.handle(Event::Offered(offer(2, 2)));
    assert_eq!(
        u.handle(Event::ChunkCorrupt {
            version: 2,
            index: 1
        }),
        vec![Action::Fetch {
            version: 2,
            chunks: vec![1]
        }]
    );
}

#[test]
fn each_phase_reports_its_device_state_and_target() {
    let mut u = Updater::new(MB);
    let mut seen = vec![(u.phase.device_state(), u.phase.target())];
    for ev in [
        Event::Offered(offer(4, 1)),
        Event::ChunkStored {
            version: 4,
            index: 0,
        },
        Event::Verified { version: 4 },
        Event::Staged { version: 4 },
        Event::HealthPassed { version: 4 },
        Event::Activated { version: 4 },
    ] {
        u.handle(ev);
        seen.push((u.phase.device_state(), u.phase.target()));
    }
    assert_eq!(
        seen,
        vec![
            (DeviceState::Idle, None),
            (DeviceState::Downloading, Some(4)),
            (DeviceState::Verifying, Some(4)),
            (DeviceState::Staged, Some(4)),
            (DeviceState::HealthCheck, Some(4)),
            (DeviceState::Activating, Some(4)),
            (DeviceState::Idle, None),
        ]
    );
}
