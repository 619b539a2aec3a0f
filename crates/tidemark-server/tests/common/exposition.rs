//! `/metrics` read as Prometheus reads it: the exposition parsed by a
//! Prometheus text-format parser, looked up by series, and linted against
//! the naming, typing and stage conventions (O1).

use std::collections::BTreeMap;

use prometheus_parse::{Scrape, Value};

use super::TestServer;

pub struct Exposition {
    pub text: String,
    pub scrape: Scrape,
}

pub async fn scrape(ts: &TestServer) -> Exposition {
    scrape_url(&ts.running().url()).await
}

/// The exposition of the server at `url` (one not started by
/// [`TestServer`], e.g. a second server on the same store).
pub async fn scrape_url(url: &str) -> Exposition {
    let text = reqwest::get(format!("{url}/metrics")).await.unwrap().text().await.unwrap();
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("the exposition parses");
    Exposition { text, scrape }
}

impl Exposition {
    /// `# TYPE` of every family.
    pub fn types(&self) -> BTreeMap<String, String> {
        self.text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (name, kind) = l.split_once(' ').expect("TYPE line has a name and a type");
                (name.to_owned(), kind.to_owned())
            })
            .collect()
    }

    /// The value of one series: `name` with exactly these labels besides
    /// `stage` (which every series has; `lint` checks it). A histogram's
    /// value is its count of observations.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let sample = self.sample(name, labels);
        match &sample.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(h) => h.iter().map(|b| b.count).fold(0.0, f64::max),
            Value::Summary(_) => panic!("{name} is a summary"),
        }
    }

    pub fn sample(&self, name: &str, labels: &[(&str, &str)]) -> &prometheus_parse::Sample {
        self.scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == name
                    && s.labels.iter().filter(|(k, _)| k.as_str() != "stage").count() == labels.len()
                    && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
            })
            .unwrap_or_else(|| panic!("no series {name}{labels:?} in\n{}", self.text))
    }

    /// The sum of a histogram's observations.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let sum = format!("{name}_sum");
        let sample = self
            .scrape
            .samples
            .iter()
            .find(|s| s.metric == sum && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)));
        match sample.map(|s| &s.value) {
            Some(Value::Untyped(v) | Value::Counter(v) | Value::Gauge(v)) => *v,
            // The parser folds `_sum` into the histogram sample.
            _ => panic!("no {sum}{labels:?} in\n{}", self.text),
        }
    }

    /// Every convention violation found, one line each.
    pub fn lint(&self) -> Vec<String> {
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
            if kind == "histogram"
                && !["_seconds", "_requests", "_events", "_conversations"].iter().any(|u| name.ends_with(u))
            {
                problems.push(format!("{name}: histogram without a unit suffix"));
            }
        }
        // Stages (O1): every series carries the `stage` label its family
        // declares, one of seed §18.1's stages.
        let stages: BTreeMap<&str, &str> =
            tidemark_server::metrics::FAMILIES.iter().map(|f| (f.metric.name, f.metric.stage)).collect();
        for s in &self.scrape.samples {
            let Some(declared) = stages.get(s.metric.as_str()) else { continue };
            match s.labels.get("stage") {
                Some(stage) if stage == *declared => {}
                other => problems.push(format!("{}: stage {other:?}, declared {declared}", s.metric)),
            }
            if !tidemark_store::metric_names::stage::ALL.contains(declared) {
                problems.push(format!("{}: unknown stage {declared}", s.metric));
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
            if (s.metric.ends_with("_requests") || s.metric.ends_with("_events")) && bounds.iter().any(|b| *b < 1.0) {
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

/// Scrapes until `ready` holds (bounded: 20 s), and returns that scrape.
pub async fn wait_for(ts: &TestServer, ready: impl Fn(&Exposition) -> bool) -> Exposition {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let e = scrape(ts).await;
        if ready(&e) {
            return e;
        }
        assert!(tokio::time::Instant::now() < deadline, "the condition never held; last scrape:\n{}", e.text);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
