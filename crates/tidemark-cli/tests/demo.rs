//! `tidemark demo` runs in CI: the real binary plays the sync story on an
//! in-process server, exits 0 only if every invariant held, and prints a
//! timeline that names senders, sequence numbers, cursors and ACKs.

use std::process::Command;

#[test]
fn the_demo_plays_the_story_and_every_invariant_holds() {
    let out = Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .arg("demo")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run tidemark demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tidemark demo failed ({}):\n{stdout}\n{stderr}", out.status);

    let has = |needle: &str| stdout.lines().any(|l| l.contains(needle));
    let expected = [
        // Alice's phone sent the first message, as msg_seq 1.
        ("alice/phone", "send accepted: "),
        ("alice/phone", "#1 ("),
        // Bob's desktop applied it from its log, its cursor moved, it ACKed.
        ("bob/desktop", "sync page"),
        ("bob/desktop", "cursor "),
        ("bob/desktop", "ACK sync_seq 1 "),
        // The recall is a new event; the target becomes a placeholder.
        ("alice/phone", "recall accepted: recall event"),
        ("bob/desktop", "#4 is now a recalled placeholder"),
        // Bob reads on the desktop.
        ("bob/desktop", "read accepted"),
        // Bob's phone caught up from where its server cursor was (0) in one
        // batch, and moved its cursor over the whole conversation.
        ("bob/phone", "resume_from 0, watermark 7): applied sync_seq 1..=7"),
        ("bob/phone", "-> 6"),
        ("bob/phone", "read position "),
        ("bob/phone", "ACK sync_seq 7 "),
    ];
    for (who, what) in expected {
        assert!(
            stdout.lines().any(|l| l.contains(who) && l.contains(what)),
            "no timeline line for {who} with {what:?}:\n{stdout}"
        );
    }
    assert!(has("sync_seq 1 = "), "the page lists its events:\n{stdout}");
    assert!(has("(recall)") && has("read event: "), "control and per-user events are shown:\n{stdout}");
    assert!(has("ACKs are not reads"), "{stdout}");
    // A story: the texts are shown, the recalled one never on the phone
    // that caught up afterwards, and the two sequences explained once.
    assert!(
        stdout.lines().any(|l| l.contains("alice/phone") && l.contains("send accepted") && l.contains("\"hi Bob!\"")),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l.contains("bob/desktop") && l.contains("from alice: \"lunch at 1?\"")), "{stdout}");
    assert!(stdout.lines().any(|l| l.contains("bob/phone") && l.contains("(recalled placeholder)")), "{stdout}");
    assert!(!stdout.lines().any(|l| l.contains("bob/phone") && l.contains("lunch at 1?")), "{stdout}");
    assert_eq!(stdout.matches("msg_seq  numbers").count(), 1, "msg_seq explained once:\n{stdout}");
    assert_eq!(stdout.matches("sync_seq numbers").count(), 1, "sync_seq explained once:\n{stdout}");
    assert!(!has("queued in the outbox") && !has("engine stopped"), "no noise lines:\n{stdout}");
    assert!(!has("FAIL"), "{stdout}");
    assert!(has("all invariants hold"), "{stdout}");
}
