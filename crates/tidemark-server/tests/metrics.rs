//! `/metrics` read as Prometheus reads it: the exposition is parsed by a
//! Prometheus text-format parser and linted against the naming and typing
//! conventions (HELP and TYPE on every family, counters `_total`, units in
//! names, histogram buckets in their unit, no family under two names);
//! every family exists before any traffic; values after known traffic are
//! exactly what that traffic implies.
//!
//! The recorder is process-global: the other test in this binary sends
//! nothing and scrapes nothing, so the values read here come from the first
//! test's traffic alone under any test runner.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use prometheus_parse::{Scrape, Value};

struct Exposition {
    text: String,
    scrape: Scrape,
}

async fn scrape(ts: &TestServer) -> Exposition {
    let text = reqwest::get(format!("{}/metrics", ts.running().url())).await.unwrap().text().await.unwrap();
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("the exposition parses");
    Exposition { text, scrape }
}

impl Exposition {
    /// `# TYPE` of every family.
    fn types(&self) -> BTreeMap<String, String> {
        self.text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (name, kind) = l.split_once(' ').expect("TYPE line has a name and a type");
                (name.to_owned(), kind.to_owned())
            })
            .collect()
    }

    /// The value of one series: `name` with exactly these labels.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let sample = self
            .scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == name
                    && s.labels.iter().count() == labels.len()
                    && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
            })
            .unwrap_or_else(|| panic!("no series {name}{labels:?} in\n{}", self.text));
        match &sample.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(h) => h.iter().map(|b| b.count).fold(0.0, f64::max),
            Value::Summary(_) => panic!("{name} is a summary"),
        }
    }

    /// Every convention violation found, one line each.
    fn lint(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let types = self.types();
        for (name, kind) in &types {
            if !self.scrape.docs.contains_key(name) {
                problems.push(format!("{name}: no HELP"));
            }
            match kind.as_str() {
                "counter" if !name.ends_with("_total") => problems.push(format!("{name}: counter without _total")),
                "counter" => {}
                "gauge" | "histogram" if name.ends_with("_total") => {
                    problems.push(format!("{name}: a {kind} named like a counter"))
                }
                "gauge" | "histogram" => {}
                other => problems.push(format!("{name}: type {other} (untyped or summary)")),
            }
            if let Some(base) = name.strip_suffix("_total") {
                if types.contains_key(base) {
                    problems.push(format!("{name} and {base}: one family under two names"));
                }
            }
            if kind == "histogram" && !(name.ends_with("_seconds") || name.ends_with("_requests")) {
                problems.push(format!("{name}: histogram without a unit suffix"));
            }
        }
        // Buckets: every series of a histogram has the same bounds, ending
        // at +Inf, and a histogram of whole requests has no bucket below 1.
        for s in &self.scrape.samples {
            let Value::Histogram(buckets) = &s.value else { continue };
            let bounds: Vec<f64> = buckets.iter().map(|b| b.less_than).collect();
            if bounds.last() != Some(&f64::INFINITY) {
                problems.push(format!("{}: buckets do not end at +Inf", s.metric));
            }
            if s.metric.ends_with("_requests") && bounds.iter().any(|b| *b < 1.0) {
                problems.push(format!("{}: a count histogram with buckets below 1: {bounds:?}", s.metric));
            }
        }
        for line in self.text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    name.strip_suffix(suffix).filter(|f| types.get(*f).map(String::as_str) == Some("histogram"))
                })
                .unwrap_or(name);
            if !types.contains_key(family) {
                problems.push(format!("{name}: a series without a TYPE"));
            }
        }
        problems
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_prometheus_conventions_and_count_known_traffic() {
    let ts = TestServer::start().await;

    // Before any traffic: every family the server declares is there, at zero.
    let fresh = scrape(&ts).await;
    assert_eq!(fresh.lint(), Vec::<String>::new(), "lint of a fresh server");
    let types = fresh.types();
    let declared: BTreeSet<&str> = tidemark_server::metrics::FAMILIES.iter().map(|f| f.name).collect();
    let exposed: BTreeSet<&str> = types.keys().map(String::as_str).collect();
    assert_eq!(
        declared.difference(&exposed).collect::<Vec<_>>(),
        Vec::<&&str>::new(),
        "declared families missing before first use"
    );
    assert_eq!(fresh.value("tidemark_sends_accepted_total", &[]), 0.0);
    assert_eq!(fresh.value("tidemark_refusals_total", &[("code", "NOT_MEMBER")]), 0.0);
    assert_eq!(fresh.value("tidemark_acks_total", &[("result", "advanced")]), 0.0);

    // Known traffic: 3 sends and 1 retry, one refused login, one batch ACKed.
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for cmid in ["m1", "m2", "m3", "m1"] {
        ann.send(&conv, cmid).await;
    }
    assert_eq!(
        code(ts.http.login("ann", "wrong password", "tablet").await),
        tidemark_client::proto::ErrorCode::Unauthenticated
    );
    let mut ben = ts.device("ben", "phone").await;
    ben.sync_until(3, 10).await;
    let acked = ben.log.len();
    assert_eq!(acked, 3);

    let after = scrape(&ts).await;
    assert_eq!(after.lint(), Vec::<String>::new(), "lint after traffic");
    assert_eq!(after.value("tidemark_sends_accepted_total", &[]), 3.0);
    assert_eq!(after.value("tidemark_sends_duplicate_total", &[]), 1.0);
    assert_eq!(after.value("tidemark_refusals_total", &[("code", "UNAUTHENTICATED")]), 1.0);
    assert!(after.value("tidemark_acks_total", &[("result", "advanced")]) >= 1.0);
    assert!(after.value("tidemark_sync_pages_total", &[]) >= 1.0);
    // Fan-out wrote each message to both members' logs (sender included).
    assert_eq!(after.value("tidemark_fanout_events_total", &[]), 6.0);
    assert_eq!(after.value("tidemark_ws_connections", &[]), 2.0);
    assert!(after.value("tidemark_store_commits_total", &[]) >= 1.0);
    assert!(after.value("tidemark_store_statements_total", &[]) > fresh.value("tidemark_store_statements_total", &[]));
    assert!(after.value("tidemark_store_commit_batch_requests", &[]) >= 1.0);
    ts.stop().await;
}

/// An idle server commits nothing: the relay's poll of an empty outbox is
/// not a commit (it writes no WAL frame and costs no fsync).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_server_counts_no_commits() {
    let config =
        tidemark_server::ServerConfig { relay_poll: std::time::Duration::from_millis(10), ..Default::default() };
    let ts = TestServer::start_with(config).await;
    let before = ts.running().state.store.stats();
    // Let the relay poll the empty outbox many times: wait until the writer
    // has run at least 20 of its (empty) transactions.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while ts.running().state.store.stats().statements < before.statements + 40 {
        assert!(tokio::time::Instant::now() < deadline, "the relay never polled");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(ts.running().state.store.stats().commits, before.commits, "empty polls counted as commits");
    ts.stop().await;
}
