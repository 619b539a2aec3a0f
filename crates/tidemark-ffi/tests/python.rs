//! The SDK from a second language: Python drives it through the UniFFI
//! bindings of this crate's cdylib against a real server on 127.0.0.1
//! (tests/python/two_devices.py: two Python devices, live receive, the
//! offline outbox, a resumed device, history, typed refusals), while a
//! Rust device of the same user receives every message. The bindings are
//! generated here by this crate's `uniffi-bindgen` from the library cargo
//! built for this test; Kotlin and Swift are generated too (not run).
//! Python 3 with only its standard library is a test requirement of the
//! workspace (README), so a missing `python3` fails this test.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tidemark_client::{Client, ClientConfig, Http};
use tidemark_server::{Server, ServerConfig};

const ADMIN: &str = "ffi-admin";
/// Each wait of the script is bounded by 20 s; this bounds the whole
/// script (and Bob's wait after it) on a loaded machine.
const WAIT: Duration = Duration::from_secs(180);

/// The cdylib cargo built beside this test binary (`target/<profile>/`
/// and its `deps/`).
fn cdylib() -> PathBuf {
    let name = format!("{}tidemark_ffi{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps.join(&name), deps.parent().unwrap().join(&name)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} not found next to {}: cargo builds it with this crate", deps.display()))
}

fn bindgen(lib: &Path, language: &str, out: &Path) {
    let output = Command::new(env!("CARGO_BIN_EXE_uniffi-bindgen"))
        .args(["generate", "--library"])
        .arg(lib)
        .args(["--language", language, "--out-dir"])
        .arg(out)
        .output()
        .expect("run uniffi-bindgen");
    assert!(
        output.status.success(),
        "uniffi-bindgen {language}: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_drives_the_sdk_against_a_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let store = tidemark_sqlite::SqliteStore::open(&dir.path().join("server")).unwrap();
    let config = ServerConfig { admin_token: Some(ADMIN.into()), ..ServerConfig::default() };
    let server = Server::start("127.0.0.1:0", store, config).await.unwrap();
    let url = server.url();

    let lib = cdylib();
    let py = dir.path().join("python");
    bindgen(&lib, "python", &py);
    for language in ["kotlin", "swift"] {
        let out = dir.path().join(language);
        bindgen(&lib, language, &out);
        assert!(std::fs::read_dir(&out).unwrap().next().is_some(), "no {language} bindings written");
    }
    // The Python module loads the library from its own directory.
    std::fs::copy(&lib, py.join(lib.file_name().unwrap())).unwrap();

    // Bob's Rust device is on before Python starts, and receives live.
    assert!(Http::new(&url).create_user(ADMIN, "bob", "pw").await.unwrap().created);
    let bob = Client::open(ClientConfig::new(&url, "bob", "rust", dir.path().join("bob-rust.db")).with_password("pw"))
        .unwrap();
    bob.start().await.unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/two_devices.py");
    let mut python = tokio::process::Command::new("python3");
    python.arg(&script).args([url.as_str(), ADMIN]).arg(dir.path()).env("PYTHONPATH", &py).kill_on_drop(true);
    let output = tokio::time::timeout(WAIT, python.output())
        .await
        .expect("the Python script finishes")
        .expect("python3 runs (a test requirement of the workspace)");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    println!("{stdout}");
    assert!(output.status.success(), "python failed: {}\n{stdout}\n{stderr}", output.status);
    assert!(stdout.contains("python: all steps passed"), "{stdout}");

    // What Python sent reached Bob's other device, once each, in order.
    let expected = ["hello from python", "hi from bob", "offline one", "offline two", "while bob was away"];
    let held = || async {
        let Some(conv) = bob.conversations().await?.first().map(|c| c.conv.clone()) else {
            return Ok::<_, tidemark_client::SdkError>(Vec::new());
        };
        let texts =
            bob.messages(&conv).await?.into_iter().map(|m| m.content["text"].as_str().unwrap_or_default().to_owned());
        Ok(texts.collect::<Vec<String>>())
    };
    if let Err(e) = bob.wait_for(WAIT, || async { Ok(held().await? == expected) }).await {
        panic!("bob's Rust device: {e}; holds {:?}", held().await);
    }
    bob.stop().await;
    server.stop().await;
}
