//! The command lines as a user reads them: every command's `--help`, walked through the binaries.
//! - No flag name means two things: a flag has one help text wherever it appears (defaults aside),
//!   except `--out` and `--json`, which by definition name each command's own output.
//! - docs/cli.md lists exactly the flags each command has, and the README and the guide show no
//!   other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use kestrel_tests::{run, stdout};

/// Flags whose help text is per command by design: where this command writes, what it prints.
/// Flags whose meaning is the command's own: what it writes (`--out`), reads (`--from`), prints,
/// and where it serves (`--listen`: MQTT for `broker`, HTTP for `console`), and how long what it
/// signs stays valid (`--expires-in`: a desired state for `publish`, a key list for `keys`).
const PER_COMMAND: [&str; 5] = ["--out", "--from", "--json", "--listen", "--expires-in"];

/// A command's flags with their help text (`[default: ...]` removed, whitespace collapsed).
fn flags(bin: &str, path: &[&str]) -> BTreeMap<String, String> {
    let mut args: Vec<&str> = path.to_vec();
    args.push("--help");
    let o = run(bin, &args);
    assert!(o.status.success(), "{bin} {args:?} failed");
    let text = stdout(&o);
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    let mut in_options = false;
    for line in text.lines() {
        if line.starts_with("Options:") {
            in_options = true;
            continue;
        }
        if !in_options {
            continue;
        }
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("--").or_else(|| {
            t.strip_prefix('-')
                .and_then(|r| r.split_once(", --").map(|(_, l)| l))
        }) {
            if let Some((name, help)) = current.take() {
                out.insert(name, help.join(" "));
            }
            // `--verbose...`: a flag that repeats.
            let name = rest.split([' ', '=', '<']).next().unwrap();
            let name = format!("--{}", name.trim_end_matches("..."));
            let inline = rest.split_once("  ").map(|(_, h)| h.trim().to_string());
            current = Some((name, inline.into_iter().collect()));
        } else if let Some((_, help)) = current.as_mut() {
            if !t.is_empty() {
                help.push(t.to_string());
            }
        }
    }
    if let Some((name, help)) = current.take() {
        out.insert(name, help.join(" "));
    }
    out.retain(|k, _| k != "--help" && k != "--version");
    out.into_iter()
        .map(|(k, v)| {
            let v = match v.find("[default:") {
                Some(i) => v[..i].to_string(),
                None => v,
            };
            (k, v.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .collect()
}

/// The subcommands listed by `BIN [PATH] --help`.
fn subcommands(bin: &str, path: &[&str]) -> Vec<String> {
    let mut args: Vec<&str> = path.to_vec();
    args.push("--help");
    let text = stdout(&run(bin, &args));
    let mut out = Vec::new();
    let mut in_commands = false;
    for line in text.lines() {
        if line.starts_with("Commands:") {
            in_commands = true;
            continue;
        }
        if in_commands {
            if !line.starts_with("  ") {
                break;
            }
            let name = line.split_whitespace().next().unwrap_or("");
            if !name.is_empty() && name != "help" {
                out.push(name.to_string());
            }
        }
    }
    out
}

/// Every command path of a binary, nested subcommands included (`rollout status`).
fn commands(bin: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut todo: Vec<Vec<String>> = subcommands(bin, &[]).into_iter().map(|c| vec![c]).collect();
    while let Some(path) = todo.pop() {
        let p: Vec<&str> = path.iter().map(String::as_str).collect();
        for sub in subcommands(bin, &p) {
            let mut q = path.clone();
            q.push(sub);
            todo.push(q);
        }
        out.push(path);
    }
    out.sort();
    out
}

#[test]
fn no_flag_means_two_things() {
    for bin in ["trainer", "edge-agent"] {
        let mut seen: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
        let cmds = commands(bin);
        assert!(cmds.len() >= 4, "{bin}: too few commands found: {cmds:?}");
        for path in &cmds {
            let p: Vec<&str> = path.iter().map(String::as_str).collect();
            for (flag, help) in flags(bin, &p) {
                assert!(
                    !help.is_empty(),
                    "{bin} {}: {flag} has no help text",
                    path.join(" ")
                );
                seen.entry(flag)
                    .or_default()
                    .entry(help)
                    .or_default()
                    .push(path.join(" "));
            }
        }
        let two: Vec<_> = seen
            .iter()
            .filter(|(flag, helps)| helps.len() > 1 && !PER_COMMAND.contains(&flag.as_str()))
            .collect();
        assert!(
            two.is_empty(),
            "{bin}: flags that mean different things: {two:#?}"
        );
        // The defect this guards against: the fleet listing's --device filter is a device id.
        if bin == "trainer" {
            let device = seen.get("--device").expect("trainer status has --device");
            assert!(
                device
                    .keys()
                    .all(|h| h.to_lowercase().contains("device") && !h.contains("cuda")),
                "--device must be a device id everywhere: {device:#?}"
            );
        }
    }
}

/// The pages whose command lines are checked against `--help`: the reference (docs/cli.md, which
/// lists every flag) and the pages that show commands to type.
const CLI_PAGES: [&str; 3] = ["docs/cli.md", "README.md", "docs/guide.md"];

/// The flags the CLI blocks of [`CLI_PAGES`] give each command of `bin`: lines `BIN CMD ... --flag ...`
/// (continuation lines indented under them) and `flags of CMD, CMD: --flag ...` lines for groups.
fn documented_flags(bin: &str) -> BTreeMap<String, BTreeSet<String>> {
    let readme: String = CLI_PAGES
        .iter()
        .map(|page| {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(page);
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{page}: {e}")) + "\n"
        })
        .collect();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut in_block = false;
    let mut current: Vec<String> = Vec::new();
    let flag_words = |s: &str| -> Vec<String> {
        s.split(|c: char| c.is_whitespace() || "[]|()".contains(c))
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(|w| {
                w.trim_end_matches([',', '.', ':'])
                    .split('=')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    for line in readme.lines() {
        if line.starts_with("```") {
            in_block = !in_block;
            current.clear();
            continue;
        }
        if !in_block {
            continue;
        }
        if let Some(rest) = line.strip_prefix(&format!("{bin} flags of ")) {
            let (cmds, flags) = rest.split_once(':').expect("`flags of A, B: --x ...`");
            // `flags of every command:` (global flags) under the key "*".
            current = match cmds.trim() {
                "every command" => vec!["*".to_string()],
                cmds => cmds.split(',').map(|c| c.trim().to_string()).collect(),
            };
            for c in &current {
                out.entry(c.clone()).or_default().extend(flag_words(flags));
            }
        } else if let Some(rest) = line.strip_prefix(&format!("{bin} ")) {
            let words: Vec<&str> = rest.split_whitespace().collect();
            let mut name = vec![words[0].to_string()];
            if words.len() > 1
                && !words[1].starts_with('-')
                && words[1].chars().all(|c| c.is_ascii_lowercase())
            {
                name.push(words[1].to_string());
            }
            current = vec![name.join(" ")];
            out.entry(current[0].clone())
                .or_default()
                .extend(flag_words(rest));
        } else if line.starts_with(' ') && !current.is_empty() {
            for c in &current {
                out.entry(c.clone()).or_default().extend(flag_words(line));
            }
        } else {
            current.clear();
        }
    }
    out
}

#[test]
fn documented_commands_match_help() {
    for bin in ["trainer", "edge-agent"] {
        let mut documented = documented_flags(bin);
        let global = documented.remove("*").unwrap_or_default();
        for doc in documented.values_mut() {
            doc.extend(global.iter().cloned());
        }
        for path in commands(bin) {
            let p: Vec<&str> = path.iter().map(String::as_str).collect();
            let name = path.join(" ");
            let actual: BTreeSet<String> = flags(bin, &p).into_keys().collect();
            let Some(doc) = documented.get(&name) else {
                // A command with subcommands of its own may be documented only through them.
                assert!(
                    !subcommands(bin, &p).is_empty(),
                    "docs/cli.md documents no `{bin} {name}`"
                );
                continue;
            };
            let missing: Vec<_> = actual.difference(doc).collect();
            let extra: Vec<_> = doc.difference(&actual).collect();
            assert!(
                missing.is_empty() && extra.is_empty(),
                "the docs' `{bin} {name}` differs from --help: not in docs/cli.md {missing:?}, not in --help {extra:?} (docs/cli.md, README.md or docs/guide.md)"
            );
        }
        for name in documented.keys() {
            let p: Vec<&str> = name.split(' ').collect();
            assert!(
                run(bin, &[p.as_slice(), &["--help"]].concat())
                    .status
                    .success(),
                "the docs show `{bin} {name}`, which does not exist"
            );
        }
    }
}

/// Each documented exit status, from a command typed as a user would: 1 a failed check, 2 usage,
/// 3 a broker that does not answer and a wait that times out, 78 a configuration error.
#[test]
fn exit_codes_say_what_failed() {
    use kestrel_tests::fleet::{Broker, BrokerKind, free_port};
    let tmp = tempfile::tempdir().unwrap();
    let code = |args: &[&str]| {
        let o = run("trainer", args);
        (o.status.code(), kestrel_tests::stderr(&o))
    };
    let corrupt = tmp.path().join("corrupt.jpg");
    std::fs::write(&corrupt, b"\xff\xd8 not a JPEG").unwrap();
    let nowhere = format!("mqtt://127.0.0.1:{}", free_port());
    let b = Broker::start(BrokerKind::Rumqttd, &tmp.path().join("broker"));
    let url = b.url();
    let missing = tmp.path().join("no-password");
    let cases: [(&[&str], i32); 6] = [
        (
            &["classify", "--engine", "tract", corrupt.to_str().unwrap()],
            1,
        ),
        (&["fit", "--no-such-flag"], 2),
        (&["status", "--broker", &nowhere], 3),
        (
            &[
                "status",
                "--broker",
                &url,
                "--device",
                "pi-none",
                "--wait-active",
                "1",
                "--timeout",
                "1",
            ],
            3,
        ),
        (&["status", "--broker", "http://example.org"], 78),
        (
            &[
                "status",
                "--broker",
                &url,
                "--username",
                "u",
                "--password-file",
                missing.to_str().unwrap(),
            ],
            78,
        ),
    ];
    for (args, want) in cases {
        let (got, err) = code(args);
        assert_eq!(got, Some(want), "trainer {args:?}: {err}");
    }
    // And the list is in --help.
    let help = stdout(&run("trainer", &["--help"]));
    assert!(help.contains("Exit status: 0 done; 1 failed"), "{help}");
}
