//! The documentation points at things that exist: every relative link in README.md and docs/*.md
//! resolves, and every repository path they name in backticks (`scripts/bench.sh`,
//! `edge-agent/deploy/kestrel.acl`, ...) is there.

use std::path::{Path, PathBuf};

/// The top-level entries of the repository a named path may start with.
const ROOTS: [&str; 13] = [
    ".ci/",
    ".config/",
    "docs/",
    "edge-agent/",
    "fleet/",
    "fuzz/",
    "models/",
    "scripts/",
    "shared/",
    "tests/",
    "trainer/",
    "Cargo.toml",
    "Cross.toml",
];

/// What is wrong with the links and named paths of the Markdown `text` of file `file` (a path
/// relative to the repository `root`): one line per problem, naming the file and line.
fn problems(root: &Path, file: &str, text: &str) -> Vec<String> {
    let dir = Path::new(file).parent().unwrap_or(Path::new(""));
    let mut out = Vec::new();
    let mut in_code = false;
    for (n, line) in text.lines().enumerate() {
        let at = format!("{file}:{}", n + 1);
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // [text](target): relative targets must exist (anchors are not checked).
        for target in line.split("](").skip(1).filter_map(|r| r.split(')').next()) {
            let target = target.split('#').next().unwrap_or("").trim();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if !root.join(dir).join(target).exists() {
                out.push(format!("{at}: link to {target}, which does not exist"));
            }
        }
        // `path`: a repository path in backticks must exist.
        for (i, span) in line.split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            if let Some(p) = named_path(span)
                && !root.join(&p).exists()
            {
                out.push(format!("{at}: names {}, which does not exist", p.display()));
            }
        }
    }
    out
}

/// The repository path a backticked span names, if it is one: starts at a top-level entry, has no
/// placeholders or globs, no spaces (a command), and may end in `:LINE` or `/`.
fn named_path(span: &str) -> Option<PathBuf> {
    let span = span.trim();
    if span.contains(|c: char| c.is_whitespace() || "<>*{}$|=…".contains(c)) {
        return None;
    }
    if !ROOTS.iter().any(|r| span.starts_with(r)) {
        return None;
    }
    let path = span.split(':').next().unwrap_or(span);
    Some(PathBuf::from(path.trim_end_matches('/')))
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn every_link_and_named_path_of_the_docs_exists() {
    let root = repo();
    let mut pages = vec!["README.md".to_string()];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            pages.push(format!("docs/{name}"));
        }
    }
    let mut all = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(root.join(page)).unwrap();
        all.extend(problems(&root, page, &text));
    }
    assert!(pages.len() > 5, "{pages:?}");
    assert!(all.is_empty(), "{}", all.join("\n"));
}

/// The check fails on what it is meant to catch (and only on that).
#[test]
fn a_broken_link_or_a_missing_path_is_named() {
    let text = "See [the guide](guide.md), [the protocol](protocol.md#topics) and \
                [gone](nowhere.md), [web](https://example.com).\n\
                Run `scripts/test.sh`, not `scripts/no-such.sh`; `trainer fit --data X` is a command,\n\
                `docs/<page>.md` a pattern, `trainer/src/main.rs:12` a line.\n\
                ```\n[in code](missing.md) `scripts/missing-in-code.sh`\n```\n";
    let p = problems(&repo(), "docs/example.md", text);
    assert_eq!(
        p,
        vec![
            "docs/example.md:1: link to nowhere.md, which does not exist".to_string(),
            "docs/example.md:2: names scripts/no-such.sh, which does not exist".to_string(),
        ]
    );
}
