//! The operator's help texts and logs: every flag of `serve`, the `user`
//! and `device` subcommands and `chat` says what it does, none quotes a
//! requirement id, RUST_LOG is mentioned, no secret is a command-line
//! flag, and stderr carries no ANSI colour codes when it is not a terminal.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tidemark")).args(args).arg("--help").output().unwrap();
    assert!(out.status.success(), "{args:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The option lines (`  --flag <V>  description`, or the flag alone on
/// its line with the description below) without a description.
fn undescribed(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut bare = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if !(t.starts_with("--") || (t.starts_with('-') && t.chars().nth(2) == Some(','))) {
            continue;
        }
        // `--flag <VALUE>` then two spaces and the description on the same
        // line, or a more indented description on the next line.
        let same_line = t.split("  ").skip(1).any(|s| !s.trim().is_empty());
        let indent = line.len() - t.len();
        let next = lines.get(i + 1).copied().unwrap_or("");
        let next_line = next.len() - next.trim_start().len() > indent && !next.trim_start().starts_with('-');
        if !same_line && !next_line {
            bare.push(t.to_owned());
        }
    }
    bare
}

/// A requirement id such as `(L1)`, `(D2 …)` or `L3` in parentheses.
fn requirement_ids(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut found = Vec::new();
    for w in chars.windows(3) {
        if w[0] == '(' && w[1].is_ascii_uppercase() && w[2].is_ascii_digit() {
            found.push(w.iter().collect());
        }
    }
    found
}

#[test]
fn every_flag_is_described_without_requirement_ids() {
    for args in [
        &["serve"][..],
        &["user", "add"],
        &["user", "list"],
        &["user", "logout"],
        &["user", "deactivate"],
        &["user", "delete"],
        &["user", "audit"],
        &["device", "list"],
        &["device", "revoke"],
        &["chat"],
        &["demo"],
        &[],
    ] {
        let text = help(args);
        assert_eq!(undescribed(&text), Vec::<String>::new(), "tidemark {args:?} --help:\n{text}");
        assert_eq!(requirement_ids(&text), Vec::<String>::new(), "tidemark {args:?} --help:\n{text}");
    }
    for args in [&["serve"][..], &[], &["chat"]] {
        assert!(help(args).contains("RUST_LOG"), "tidemark {args:?} --help mentions RUST_LOG");
    }
    let serve = help(&["serve"]);
    assert!(!serve.contains("--admin-token <"), "no admin token on the command line:\n{serve}");
    assert!(serve.contains("--admin-token-file") && serve.contains("TIDEMARK_ADMIN_TOKEN"), "{serve}");
    let chat = help(&["chat"]);
    assert!(!chat.contains("--password <"), "no password on the command line:\n{chat}");
    assert!(chat.contains("--password-file") && chat.contains("TIDEMARK_PASSWORD"), "{chat}");
}

#[test]
fn the_checks_see_what_they_look_for() {
    assert_eq!(undescribed("Options:\n      --listen <LISTEN>\n  -h, --help  Print help\n"), ["--listen <LISTEN>"]);
    assert!(undescribed("      --listen <L>\n          Where to listen\n").is_empty());
    assert_eq!(requirement_ids("retention (L1): entries"), ["(L1"]);
    assert!(requirement_ids("(default info)").is_empty());
}

#[test]
fn serve_logs_without_colour_codes_when_stderr_is_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path())
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("tidemark listening on "), "{line}");
    child.kill().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    child.wait().unwrap();
    assert!(stderr.contains("INFO"), "serve logs at info by default: {stderr}");
    assert!(!stderr.contains('\u{1b}'), "ANSI escape codes in a redirected stderr: {stderr:?}");
}
