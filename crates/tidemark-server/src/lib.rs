//! The Tidemark server: gateway, services and background workers.
//!
//! - [`accounts`]: the account rules (names, password bounds, hashing,
//!   verification), used by the gateway, the CLI and the benchmarks.
//! - [`gateway`]: WebSocket `/v1/ws` and HTTP `/v1/rpc/<op>`, both calling
//!   the same handler per operation ([`ops`]); login, refresh, admin,
//!   health, metrics and the OpenAPI document.
//! - [`ops`]: one module per operation: parse, apply through the store,
//!   reply. Identity comes only from the verified access token (P1).
//! - [`relay`]: the outbox relay: reloads the outbox at start-up and fans
//!   out committed events, then hints the recipients' connected devices.
//! - [`hub`]: live connections per user, coalesced hints, kicks, re-hints.
//! - [`bus`]: the hint bus carrying hints to the other nodes (NATS), or
//!   nowhere when the node runs alone.
//! - [`route`]: in cluster mode, sends forwarded over the bus to their
//!   conversation's owner node, which writes them (issue 14).
//! - [`fence`]: revocation and superseding on every node: applied at once
//!   where they commit, carried by the bus, reloaded from the store.
//! - [`ephemeral`]: typing and presence of this node's connections,
//!   bounded, coalesced and shed first; never written to a sync log.
//!
//! The server holds no message state of its own: every fact is in the
//! store, hints are only hints (D8), and two servers can run in one process
//! because every dependency is passed in explicitly.

/// One line of a message's stage trace (O2, seed §18.2): a debug event on
/// the target `tidemark::trace`, so an operator turns traces on alone
/// (`RUST_LOG=info,tidemark::trace=debug`) and `--log-format json` writes
/// them as JSON lines. Every line carries `stage` (the metric stages of
/// `tidemark_store::metric_names::stage`) and `trace_id`; ids of users and
/// devices only as `AppState::log_id` hashes; never a body, a token, a
/// password or a push payload. A message's `trace_id` is its message id,
/// so every node names it without carrying context; a device's batch
/// (its pages and their ACK) is traced by the batch token's tag.
#[macro_export]
macro_rules! trace_stage {
    ($($field:tt)*) => {
        tracing::debug!(target: "tidemark::trace", $($field)*)
    };
}

pub mod accounts;
pub mod audit;
pub mod bus;
pub mod config;
pub mod degrade;
pub mod ephemeral;
pub mod error;
pub mod fence;
pub mod gateway;
pub mod groups;
pub mod hub;
pub mod limits;
pub mod listener;
pub mod metrics;
pub mod ops;
pub mod push;
pub mod reconcile;
pub mod relay;
pub mod route;
pub mod server;
pub mod sessions;
pub mod state;
pub mod util;

pub use config::ServerConfig;
pub use server::{RunningServer, Server};
pub use state::AppState;
