//! The operator's view stays true to the exporter: every metric the
//! Grafana dashboard (`ops/grafana/tidemark.json`) and the operator's guide
//! (`docs/operations.md`) name is a family `/metrics` exposes (a fresh
//! server registers every declared family, `tests/metrics.rs`), every
//! family is on both, and the dashboard's rows are the stages of seed
//! §18.1 in order.

use std::collections::BTreeSet;

use tidemark_server::metrics::FAMILIES;
use tidemark_store::metric_names::stage;

const DASHBOARD: &str = include_str!("../../../ops/grafana/tidemark.json");
const GUIDE: &str = include_str!("../../../docs/operations.md");

/// Every `tidemark_…` metric name in `text`, a histogram's `_bucket`,
/// `_sum` and `_count` series folded into their family.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("tidemark_") {
        let tail = &rest[at..];
        let end =
            tail.find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
        let name = &tail[..end];
        let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
        names.insert(family.to_owned());
        rest = &tail[end..];
    }
    names
}

fn declared() -> BTreeSet<String> {
    FAMILIES.iter().map(|f| f.name().to_owned()).collect()
}

/// Crate paths share the prefix in the guide's prose (`tidemark_store::…`).
fn metric_like(names: BTreeSet<String>) -> BTreeSet<String> {
    names.into_iter().filter(|n| !["tidemark_store", "tidemark_core"].contains(&n.as_str())).collect()
}

#[test]
fn the_dashboard_shows_every_family_and_only_families_by_stage() {
    let dash: serde_json::Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let panels = dash["panels"].as_array().expect("panels");
    let exprs: String = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .map(|t| t["expr"].as_str().expect("every target has an expression"))
        .collect::<Vec<_>>()
        .join("\n");
    let used = names_in(&exprs);
    let declared = declared();
    assert_eq!(
        used.difference(&declared).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "unknown metrics on the dashboard"
    );
    assert_eq!(
        declared.difference(&used).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "families missing from the dashboard"
    );
    let rows: Vec<&str> = panels
        .iter()
        .filter(|p| p["type"] == "row")
        .map(|p| p["title"].as_str().unwrap().split(' ').next().unwrap())
        .collect();
    assert_eq!(rows, stage::ALL, "one row per stage, in seed §18.1's order");
}

#[test]
fn the_guide_names_every_family_and_only_families() {
    let mentioned = metric_like(names_in(GUIDE));
    let declared = declared();
    assert_eq!(
        mentioned.difference(&declared).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "docs/operations.md names metrics that do not exist"
    );
    assert_eq!(
        declared.difference(&mentioned).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "families docs/operations.md does not explain"
    );
}
