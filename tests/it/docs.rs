//! The documentation holds: every relative link and `#anchor` of README.md, docs/, benches/,
//! CONTRIBUTING.md and CHANGELOG.md resolves; every `console` block of README.md and docs/ runs
//! against a sandbox and prints what the page shows; the completion scripts and man pages
//! come from the CLI's definition and are well formed; `--help` offers only what a command
//! accepts.
//!
//! A `console` block is a transcript, in trycmd's syntax: `$ imgpipe ARGS` runs the binary,
//! an optional `? CODE` line right after it gives the exit code (0 otherwise), and the lines
//! up to the next `$` are its stdout. In an expected line `[..]` stands for any text (a path,
//! a time), and a line `...` for any lines. A block opened with ```` ```yaml file=NAME ```` is a
//! file the reader writes: its text is written to NAME before the next command runs. Each page
//! runs in a directory of its own holding a copy of `pipelines/`, with its own state database
//! and its own sandbox (`IMGPIPE_BASE_URL`, its key `demo` as the tutorial starts it), the
//! blocks of a page one after another, as a reader would type them.
//! (trycmd itself runs each block in a fresh process and compares stdout and stderr together,
//! where imgpipe's stderr carries log lines with times: a small runner here is simpler.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::common;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown pages the links test reads: README.md, CONTRIBUTING.md, CHANGELOG.md, and
/// every `.md` under docs/ and benches/.
fn pages() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"]
        .iter()
        .map(|p| root().join(p))
        .collect();
    for dir in ["docs", "benches"] {
        out.extend(markdown_under(&root().join(dir)));
    }
    out
}

fn markdown_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            out.extend(markdown_under(&path));
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    out
}

/// GitHub's anchor of a heading: lowercase, spaces to `-`, punctuation other than `-` and `_`
/// dropped; a repeated anchor gets `-1`, `-2`, ….
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in outside_code(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_default();
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

/// The lines of a Markdown text that are not inside a fenced code block.
fn outside_code(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |l| {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// Every `](target)` of a text outside code blocks and inline code.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in outside_code(text) {
        // Inline code may hold `](` that is no link.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            out.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            let shown = format!(
                "{}: ({target})",
                page.strip_prefix(root()).unwrap().display()
            );
            if !file.exists() {
                broken.push(format!("{shown}: no {}", file.display()));
                continue;
            }
            if !anchor.is_empty() {
                let there = std::fs::read_to_string(&file).unwrap_or_default();
                if !anchors(&there).contains(anchor) {
                    broken.push(format!("{shown}: no heading #{anchor} there"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_githubs_rules() {
    let text = "# The plan document (`plan --json`, `plan --save PLAN.json`)\n## Exit codes\n```\n# not a heading\n```\n## Exit codes\n";
    let got = anchors(text);
    let want: BTreeSet<String> = [
        "the-plan-document-plan---json-plan---save-planjson",
        "exit-codes",
        "exit-codes-1",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(got, want);
}

/// The exit codes `src/error.rs` defines, from its `pub const NAME: u8 = N;` lines.
fn exit_codes() -> BTreeSet<u8> {
    let text = std::fs::read_to_string(root().join("src/error.rs")).unwrap();
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("pub const ")?.split_once(": u8 = "))
        .map(|(_, n)| n.trim_end_matches(';').parse().unwrap())
        .collect()
}

/// Every exit code has a row in README's table and in the reference's, and an answer in the
/// FAQ that a link can reach (`faq.md#exit-N`).
#[test]
fn every_exit_code_is_in_the_tables_and_the_faq() {
    let codes = exit_codes();
    assert!(
        codes.contains(&130),
        "read no codes from src/error.rs: {codes:?}"
    );
    let faq = anchors(&std::fs::read_to_string(root().join("docs/reference/faq.md")).unwrap());
    let mut missing = Vec::new();
    for code in &codes {
        for table in ["README.md", "docs/reference/exit-codes.md"] {
            let text = std::fs::read_to_string(root().join(table)).unwrap();
            if !text.lines().any(|l| l.starts_with(&format!("| {code} |"))) {
                missing.push(format!("{table} has no row for exit {code}"));
            }
        }
        if !faq.contains(&format!("exit-{code}")) {
            missing.push(format!(
                "docs/reference/faq.md has no heading \"Exit {code}\""
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// One command of a transcript: the files written before it (name, text), its words, its
/// exit code and its expected stdout.
#[derive(Debug)]
struct Step {
    line: usize,
    files: Vec<(String, String)>,
    args: Vec<String>,
    code: i32,
    expected: Vec<String>,
}

/// What the fenced block being read is.
enum Block {
    Outside,
    Console,
    File(String, String),
    Other,
}

/// The commands of the `console` blocks of a page, each with the `file=` blocks before it.
fn transcript(text: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut files = Vec::new();
    let mut block = Block::Outside;
    for (n, line) in text.lines().enumerate() {
        if line.starts_with("```") {
            block = match std::mem::replace(&mut block, Block::Outside) {
                Block::File(name, text) => {
                    files.push((name, text));
                    Block::Outside
                }
                Block::Console | Block::Other => Block::Outside,
                Block::Outside if line.trim() == "```console" => Block::Console,
                Block::Outside => match line.split_once(" file=") {
                    Some((_, name)) => Block::File(name.trim().to_owned(), String::new()),
                    None => Block::Other,
                },
            };
            continue;
        }
        if let Block::File(_, text) = &mut block {
            *text += line;
            text.push('\n');
        }
        if !matches!(block, Block::Console) {
            continue;
        }
        if let Some(command) = line.strip_prefix("$ ") {
            let words = words(command);
            assert_eq!(
                words.first().map(String::as_str),
                Some("imgpipe"),
                "line {}: a console block runs imgpipe only",
                n + 1
            );
            steps.push(Step {
                line: n + 1,
                files: std::mem::take(&mut files),
                args: words[1..].to_vec(),
                code: 0,
                expected: Vec::new(),
            });
        } else if let Some(step) = steps.last_mut() {
            match line.strip_prefix("? ") {
                Some(code) if step.expected.is_empty() => step.code = code.parse().unwrap(),
                _ => step.expected.push(line.to_owned()),
            }
        }
    }
    assert!(
        files.is_empty(),
        "a file block after the last command is never used"
    );
    steps
}

/// Words of a command line as a POSIX shell splits them, single and double quotes included.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word: Option<String> = None;
    let mut quote = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_default().push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                word.get_or_insert_default();
            }
            (None, c) if c.is_whitespace() => out.extend(word.take()),
            (None, c) => word.get_or_insert_default().push(c),
        }
    }
    out.extend(word);
    out
}

/// Whether `actual` matches the expected line, `[..]` standing for any text.
fn line_matches(expected: &str, actual: &str) -> bool {
    let parts: Vec<&str> = expected.split("[..]").collect();
    if parts.len() == 1 {
        return expected == actual;
    }
    let mut rest = actual;
    for (i, part) in parts.iter().enumerate() {
        if i == 0 {
            let Some(r) = rest.strip_prefix(part) else {
                return false;
            };
            rest = r;
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            let Some(at) = rest.find(part) else {
                return false;
            };
            rest = &rest[at + part.len()..];
        }
    }
    true
}

/// Whether the lines match, a `...` line standing for any lines.
fn lines_match(expected: &[String], actual: &[&str]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((first, rest)) if first == "..." => {
            (0..=actual.len()).any(|skip| lines_match(rest, &actual[skip..]))
        }
        Some((first, rest)) => actual
            .split_first()
            .is_some_and(|(a, more)| line_matches(first, a) && lines_match(rest, more)),
    }
}

fn trimmed<S: AsRef<str>>(lines: &[S]) -> Vec<&str> {
    let mut out: Vec<&str> = lines.iter().map(|l| l.as_ref().trim_end()).collect();
    while out.last().is_some_and(|l| l.is_empty()) {
        out.pop();
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if path.is_dir() {
            if name != "out" {
                copy_dir(&path, &to.join(name));
            }
        } else {
            std::fs::copy(&path, to.join(name)).unwrap();
        }
    }
}

/// Runs the transcript of `page` (relative to the repository) and fails naming each command
/// whose exit code or stdout differs from what the page shows.
async fn run_page(page: &str) {
    let text = std::fs::read_to_string(root().join(page)).unwrap();
    let steps = transcript(&text);
    assert!(!steps.is_empty(), "{page} shows no console block");
    let env = common::start(imgpipe::sandbox::Config {
        image_side: common::SAMPLE_SIDE,
        key: Some("demo".into()),
        ..imgpipe::sandbox::Config::default()
    })
    .await;
    let dir = env.dir.path();
    copy_dir(&root().join("pipelines"), &dir.join("pipelines"));
    let mut failures = Vec::new();
    for step in &steps {
        for (name, text) in &step.files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let args: Vec<&str> = step.args.iter().map(String::as_str).collect();
        let mut cmd = common::Imgpipe::new(&args).cwd(dir).command();
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key())
            .env("HOME", dir.join("home"))
            .env("XDG_STATE_HOME", dir.join("state"))
            .env("COLUMNS", "100");
        let out = common::finish(cmd).await;
        let stdout = common::stdout(&out);
        let actual: Vec<&str> = stdout.lines().collect();
        let code = out.status.code().unwrap_or(-1);
        let expected: Vec<String> = trimmed(&step.expected)
            .into_iter()
            .map(String::from)
            .collect();
        if code != step.code || !lines_match(&expected, &trimmed(&actual)) {
            failures.push(format!(
                "{page}:{}: $ imgpipe {}\nexpected exit {}, got {code}; expected stdout:\n{}\ngot:\n{stdout}stderr:\n{}",
                step.line,
                step.args.join(" "),
                step.code,
                expected.join("\n"),
                common::stderr(&out)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn readme_tour_prints_what_it_shows() {
    run_page("README.md").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn review_loop_guide_prints_what_it_shows() {
    run_page("docs/guides/review-loop.md").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn first_pipeline_tutorial_prints_what_it_shows() {
    run_page("docs/tutorial/first-pipeline.md").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn caps_and_spend_guide_prints_what_it_shows() {
    run_page("docs/guides/spending-caps.md").await;
}

/// The reference's `--help` texts are those of the binary, so it lists every flag there is.
#[tokio::test(flavor = "multi_thread")]
async fn command_reference_is_the_binarys_help() {
    run_page("docs/reference/commands.md").await;
}

#[test]
fn transcript_syntax() {
    let steps = transcript(
        "```yaml file=p.yaml\nname: p\n```\n```console\n$ imgpipe run 'a b' --x\n? 7\nrun [..]: stopped\n...\n```\n```sh\n$ imgpipe no\n```\n",
    );
    assert_eq!(steps.len(), 1);
    assert_eq!(
        steps[0].files,
        [("p.yaml".to_owned(), "name: p\n".to_owned())]
    );
    assert_eq!(steps[0].args, ["run", "a b", "--x"]);
    assert_eq!(steps[0].code, 7);
    assert!(lines_match(
        &steps[0].expected,
        &["run x: stopped", "more", "lines"]
    ));
    assert!(!lines_match(&steps[0].expected, &["run x: failed"]));
    assert!(line_matches("a [..] c [..]", "a b c d"));
    assert!(!line_matches("a [..] c", "a b d"));
}

/// The subcommands `imgpipe --help` lists, `help` aside.
async fn subcommands() -> Vec<String> {
    let out = common::Imgpipe::new(&["--help"]).cwd(root()).run().await;
    let text = common::stdout(&out);
    let list = text.split("Commands:").nth(1).unwrap();
    list.lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn bash_completions_parse_and_name_every_command() {
    let dir = tempfile::tempdir().unwrap();
    for shell in ["bash", "zsh", "fish", "powershell"] {
        let out = common::Imgpipe::new(&["completions", shell])
            .cwd(dir.path())
            .run()
            .await;
        common::assert_exit(&out, 0);
        assert!(!out.stdout.is_empty(), "no {shell} script");
    }
    let out = common::Imgpipe::new(&["completions", "bash"])
        .cwd(dir.path())
        .run()
        .await;
    let script = dir.path().join("imgpipe.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    let checked = std::process::Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "bash -n: {}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let text = common::stdout(&out);
    let commands = subcommands().await;
    assert!(commands.len() >= 17, "{commands:?}");
    for command in &commands {
        assert!(
            text.contains(&format!("imgpipe__subcmd__{command}")),
            "the bash completions do not name `{command}`"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn man_pages_for_every_command_render_without_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("man1");
    let out = common::Imgpipe::new(&["man", "--out", out_dir.to_str().unwrap()])
        .cwd(dir.path())
        .run()
        .await;
    common::assert_exit(&out, 0);
    let mut pages = vec!["imgpipe.1".to_owned()];
    for command in subcommands().await {
        pages.push(format!("imgpipe-{command}.1"));
    }
    pages.extend(
        [
            "imgpipe-cap-set.1",
            "imgpipe-cap-list.1",
            "imgpipe-cap-remove.1",
        ]
        .map(String::from),
    );
    for page in &pages {
        assert!(
            out_dir.join(page).is_file(),
            "no {page} in {:?}",
            common::entries(&out_dir)
        );
    }
    let groff = Path::new("/usr/bin/groff");
    if !groff.exists() {
        common::skip_unless_ci(
            "groff",
            "/usr/bin/groff is missing",
            "apt-get install groff",
        );
        return;
    }
    for page in &pages {
        let rendered = std::process::Command::new(groff)
            .args(["-man", "-ww", "-Tutf8"])
            .arg(out_dir.join(page))
            .output()
            .unwrap();
        let warnings = String::from_utf8_lossy(&rendered.stderr);
        assert!(
            rendered.status.success() && warnings.trim().is_empty(),
            "groff on {page}: {warnings}"
        );
        assert!(!rendered.stdout.is_empty(), "{page} renders empty");
    }
}

/// `reroll --help` offers only what a reroll accepts: not `--items` nor `--until`, which
/// `run` and `resume` take; and a reroll given them is refused by clap, exit 2.
#[tokio::test(flavor = "multi_thread")]
async fn reroll_help_lists_only_what_a_reroll_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let help = |cmd: &'static str| {
        let dir = dir.path().to_owned();
        async move { common::stdout(&common::Imgpipe::new(&[cmd, "--help"]).cwd(&dir).run().await) }
    };
    let reroll = help("reroll").await;
    for flag in ["--items", "--until"] {
        assert!(
            !reroll.contains(flag),
            "reroll --help offers {flag}:\n{reroll}"
        );
    }
    assert!(
        reroll.contains("--dry-run") && reroll.contains("--max-credits"),
        "{reroll}"
    );
    for cmd in ["run", "resume"] {
        let text = help(cmd).await;
        assert!(
            text.contains("--items") && text.contains("--until"),
            "{cmd}:\n{text}"
        );
    }
    let out = common::Imgpipe::new(&["reroll", "r", "mug", "--items", "first:1"])
        .cwd(dir.path())
        .run()
        .await;
    common::assert_exit(&out, 2);
}
