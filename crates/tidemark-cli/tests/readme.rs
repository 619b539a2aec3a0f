//! README.md's walkthrough is a test, read from README.md itself so the two
//! cannot drift: the server starts as README's command 1 says (its admin
//! token and flags; only the port is free), and every ```sh block of the
//! "Walkthrough" section runs, in order, in one bash shell against it,
//! with the outputs the README shows compared with what the commands print.
//!
//! The conventions the README follows:
//! - in a ```sh block, the lines starting with `# ` after a command are
//!   its documented output, one line each, except that a JSON object
//!   whose brackets are still open continues on the next `#` line (joined
//!   without the indent); `…` stands for anything;
//! - the command running `examples/watch.py` starts the WebSocket watcher in
//!   the background; its `# ` lines are its first output, and the next
//!   ```text block is what it prints after the following ```sh block ran;
//! - `localhost:8080` is the server's address and `cargo run --release -p
//!   tidemark-cli --` the binary under test.
//!
//! Before each step the test waits until the server's outbox is drained
//! (`/healthz` `outbox_backlog` 0), as a reader would by typing slower.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// How the README invokes the binary.
const INVOCATION: &str = "cargo run --release -p tidemark-cli --";
/// The address the README's commands use.
const README_ADDR: &str = "localhost:8080";
/// Ends each step's output in the shell's stdout.
const MARKER: &str = "@@readme-step-done@@";
/// Bound on every wait (a step, the watcher's output, the outbox).
const WAIT: Duration = Duration::from_secs(30);

fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The fenced blocks of `text`: (info string, body).
fn blocks(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(info)) => current = Some((info.trim().to_owned(), String::new())),
            (Some(_), Some(_)) => out.push(current.take().unwrap()),
            (Some((_, body)), None) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// One command of a ```sh block and the output the README shows for it.
#[derive(Debug)]
struct Step {
    command: String,
    expected: Vec<String>,
}

fn steps(body: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut in_output = false;
    for line in body.lines() {
        if let Some(out) = line.strip_prefix('#') {
            let step = steps.last_mut().expect("output before any command");
            let out = out.strip_prefix(' ').unwrap_or(out);
            match step.expected.last_mut() {
                Some(open) if open.starts_with('{') && depth(open) > 0 => open.push_str(out.trim()),
                _ => step.expected.push(out.to_owned()),
            }
            in_output = true;
        } else if line.trim().is_empty() {
            continue;
        } else {
            // A line continues the command above while that one ends in
            // `\` or has a `$(` still open.
            let continues = !in_output
                && steps.last().is_some_and(|s| s.command.trim_end().ends_with('\\') || open_parens(&s.command) > 0);
            if continues {
                let s = steps.last_mut().unwrap();
                s.command.push_str(line);
                s.command.push('\n');
            } else {
                steps.push(Step { command: format!("{line}\n"), expected: Vec::new() });
            }
            in_output = false;
        }
    }
    steps
}

/// Unclosed `{` and `[` in a line of JSON.
fn depth(json: &str) -> i64 {
    json.chars().map(|c| i64::from(matches!(c, '{' | '[')) - i64::from(matches!(c, '}' | ']'))).sum()
}

/// Unclosed `(` in a command (a `$(…)` spanning lines).
fn open_parens(command: &str) -> i64 {
    command.chars().map(|c| i64::from(c == '(') - i64::from(c == ')')).sum()
}

/// `text` matches `pattern`, where `…` in the pattern stands for anything.
fn matches(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('…').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if text.len() < first.len() + last.len() || !text.starts_with(first) || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

fn check_lines(what: &str, expected: &[String], actual: &[String]) {
    assert_eq!(
        expected.len(),
        actual.len(),
        "{what}: README shows {} line(s), got {}:\nREADME:\n{}\nactual:\n{}",
        expected.len(),
        actual.len(),
        expected.join("\n"),
        actual.join("\n")
    );
    for (e, a) in expected.iter().zip(actual) {
        assert!(matches(e, a), "{what}: README shows\n  {e}\nbut the command printed\n  {a}");
    }
}

/// A bash shell kept across steps, so variables carry over as in a terminal.
struct Shell {
    child: Child,
    stdin: ChildStdin,
    stdout: std::sync::mpsc::Receiver<String>,
}

impl Shell {
    fn start(cwd: &Path) -> Shell {
        let mut child = Command::new("bash")
            .args(["--noprofile", "--norc"])
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn bash");
        let stdin = child.stdin.take().unwrap();
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Shell { child, stdin, stdout: rx }
    }

    /// Runs `command` and returns the non-empty lines it printed.
    fn run(&mut self, command: &str) -> Vec<String> {
        // curl prints no newline after a body: end the step's output with one.
        write!(self.stdin, "{command}\necho; echo {MARKER}\n").unwrap();
        self.stdin.flush().unwrap();
        let deadline = Instant::now() + WAIT;
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) if line == MARKER => return lines,
                Ok(line) if line.trim().is_empty() => {}
                Ok(line) => lines.push(line),
                Err(e) => panic!("step did not finish within {WAIT:?} ({e}): {command}\nprinted so far: {lines:?}"),
            }
        }
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Kills the background watcher, pass or fail.
struct Watcher {
    pid_file: PathBuf,
    out: PathBuf,
}

impl Watcher {
    /// The watcher's output once it holds at least `n` non-empty lines.
    fn lines(&self, n: usize) -> Vec<String> {
        let deadline = Instant::now() + WAIT;
        loop {
            let text = std::fs::read_to_string(&self.out).unwrap_or_default();
            let lines: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(str::to_owned).collect();
            if lines.len() >= n {
                return lines;
            }
            assert!(
                Instant::now() < deadline,
                "the watcher printed {} of {n} lines within {WAIT:?}:\n{text}",
                lines.len()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.pid_file) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
    }
}

/// Waits until every accepted message was fanned out.
async fn outbox_drained(url: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let health: serde_json::Value = reqwest::get(format!("{url}/healthz")).await.unwrap().json().await.unwrap();
        if health["outbox_backlog"] == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the outbox did not drain within {WAIT:?}: {health}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// README's command 1: the admin token and the `serve` flags.
fn command_one(readme: &str) -> (String, Vec<String>) {
    let line = readme.lines().find(|l| l.contains(&format!("{INVOCATION} serve"))).expect("README has a serve command");
    let admin = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("TIDEMARK_ADMIN_TOKEN="))
        .expect("command 1 sets TIDEMARK_ADMIN_TOKEN")
        .to_owned();
    let flags = line.split(&format!("{INVOCATION} serve")).nth(1).unwrap();
    let mut args = Vec::new();
    let mut words = flags.split_whitespace();
    while let Some(w) = words.next() {
        if w == "--listen" {
            words.next(); // the test picks a free port
        } else {
            args.push(w.to_owned());
        }
    }
    (admin, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_walkthrough_runs_as_written() {
    let readme = readme();
    let section = readme.split("## Walkthrough").nth(1).expect("README has a Walkthrough section");
    let section = section.split("\n## ").next().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (admin, args) = command_one(&readme);
    assert!(args.iter().any(|a| a == "./data"), "command 1 keeps its data in ./data: {args:?}");
    // Relative paths are the shell's working directory, the temp dir.
    let args: Vec<String> =
        args.iter().map(|a| a.replace("./data", &dir.path().join("data").display().to_string())).collect();
    let server = common::spawn_serve(&args, &admin);
    let addr = server.url.strip_prefix("http://").unwrap().to_owned();

    let bin = env!("CARGO_BIN_EXE_tidemark");
    let watch_py = repo_root().join("examples/watch.py");
    let mut shell = Shell::start(dir.path());
    let mut watcher: Option<Watcher> = None;
    let mut watcher_seen = 0;
    let mut ran = 0;
    for (info, body) in blocks(section) {
        match info.as_str() {
            "sh" => {
                for step in steps(&body) {
                    outbox_drained(&server.url).await;
                    let command = step
                        .command
                        .replace(README_ADDR, &addr)
                        .replace(INVOCATION, &format!("'{bin}'"))
                        .replace("examples/watch.py", &watch_py.display().to_string());
                    if command.contains("watch.py") {
                        let out = dir.path().join("watch.out");
                        let pid_file = dir.path().join("watch.pid");
                        let started = format!(
                            "{} ws://{addr}/v1/ws > '{}' 2>&1 & echo $! > '{}'",
                            command.trim_end(),
                            out.display(),
                            pid_file.display()
                        );
                        shell.run(&started);
                        let w = Watcher { pid_file, out };
                        let lines = w.lines(step.expected.len());
                        check_lines(&step.command, &step.expected, &lines);
                        watcher_seen = lines.len();
                        watcher = Some(w);
                    } else {
                        let printed = shell.run(&command);
                        if !step.expected.is_empty() {
                            check_lines(&step.command, &step.expected, &printed);
                        }
                    }
                    ran += 1;
                }
            }
            "text" => {
                let w = watcher.as_ref().expect("a ```text block follows the watcher's start");
                let expected: Vec<String> = body.lines().filter(|l| !l.trim().is_empty()).map(str::to_owned).collect();
                let lines = w.lines(watcher_seen + expected.len());
                check_lines("the watcher after the next send", &expected, &lines[watcher_seen..]);
                watcher_seen = lines.len();
            }
            other => panic!("a ```{other} block in the walkthrough: the test runs only sh and text blocks"),
        }
    }
    assert!(ran >= 8, "the walkthrough ran only {ran} steps");
    assert!(watcher.is_some(), "the walkthrough starts examples/watch.py");
    drop(watcher);
    drop(shell);
    drop(server);
}

/// Every way the README runs the binary is the one invocation (so no step
/// rebuilds another's artifacts with other features), and none hides the
/// build behind `-q`.
#[test]
fn the_readme_invokes_the_binary_one_way() {
    let readme = readme();
    let code: Vec<String> = blocks(&readme).into_iter().map(|(_, body)| body).collect();
    let lines = code.iter().flat_map(|b| b.lines());
    for line in lines.filter(|l| l.contains("cargo run") || l.contains("cargo build")) {
        let ok = line.contains(INVOCATION) || line.contains("cargo run --release -p tidemark-chaos --");
        assert!(ok, "README runs the binary another way than `{INVOCATION}`: {line}");
        assert!(!line.contains(" -q "), "a quiet build looks hung: {line}");
    }
    assert!(readme.contains("cargo install cargo-nextest --locked"), "README says how to install nextest");
}

#[test]
fn wildcards_match_as_documented() {
    let check =
        |pattern: &str, text: &str, expect: bool| assert_eq!(matches(pattern, text), expect, "{pattern} vs {text}");
    check("a…c", "abc", true);
    check("a…c", "ac", true);
    check("a…c", "abd", false);
    check("a…b…c", "axxbyyc", true);
    check("a…b…c", "axxyyc", false);
    check("ab…ba", "aba", false);
    check("exact", "exact", true);
    check("exact", "exact ", false);
}
