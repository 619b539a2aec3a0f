//! Wiring: the listener and the background workers, each with one owner
//! that awaits it and a shutdown signal, around the shared [`AppState`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tidemark_core::token::TokenKeys;
use tidemark_store::Store;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use crate::config::ServerConfig;
use crate::hub::Hub;
use crate::state::{AppState, ConnSlots, UserConnSlots};

pub struct Server;

/// A started server: its address, and the handle to stop it.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    /// Binds `listen`, reloads the outbox and starts serving.
    pub async fn start(listen: &str, store: Arc<dyn Store>, config: ServerConfig) -> std::io::Result<RunningServer> {
        crate::limits::return_large_allocations_to_the_os();
        let io = |e: tidemark_store::StoreError| std::io::Error::other(e.to_string());
        let secret = store.server_secret().await.map_err(io)?;
        let revoked = store.revoked_devices().await.map_err(io)?;
        let hub = Arc::new(Hub::default());
        let sessions = Arc::new(crate::sessions::Sessions::from_store(store.session_fences().await.map_err(io)?));
        let fences = Arc::new(crate::fence::Fences::new(hub.clone(), sessions.clone(), revoked));
        let (bus, bus_pending) = crate::bus::connect(&config.hint_bus).await.map_err(std::io::Error::other)?;
        let router = match &bus_pending {
            Some(pending) => {
                let (client, prefix) = pending.route_bus();
                crate::route::Router::on_bus(client, prefix)
            }
            None => crate::route::Router::local(),
        };
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let ws_slots = ConnSlots::new(config.ws_connections_max);
        let ws_user_slots = UserConnSlots::new(config.ws_connections_per_user_max);
        let config_limits = config.limits.clone();
        let load_bounds = config.load_bounds;
        store.set_group_policy(config.group_policy);
        let groups = Arc::new(crate::groups::GroupHints::new(store.clone(), hub.clone()));
        let lane =
            Arc::new(crate::ephemeral::Lane::new(store.clone(), config.ephemeral.clone(), bus.ephemeral_sender()));
        let push_sealer = crate::push::sealer(&config.push, &secret);
        let snapshot_builds_max = config.snapshot_builds_max.max(1);
        let state = Arc::new(AppState {
            store,
            keys: TokenKeys::from_secret(&secret),
            config,
            hub,
            groups,
            bus,
            router,
            relay_wake: Notify::new(),
            push_wake: Notify::new(),
            push_sealer,
            fences,
            metrics: crate::metrics::install(),
            shutdown: shutdown_rx.clone(),
            ws_slots,
            ws_user_slots,
            sessions,
            limits: crate::limits::Limits::new(config_limits),
            lane,
            load: crate::degrade::LoadState::new(load_bounds),
            gauges: tokio::sync::Mutex::new(None),
            snapshot_builds: tokio::sync::Semaphore::new(snapshot_builds_max),
        });
        let listener = bind(listen).await?;
        let addr = listener.local_addr()?;
        let app = crate::gateway::router(state.clone());
        let conns = state.limits.address_conns();
        let http = spawn_fatal(
            "http",
            crate::listener::serve(listener, app, state.config.http_timeouts, conns, shutdown_rx.clone()),
        );
        let relay = spawn_fatal("relay", crate::relay::run(state.clone(), shutdown_rx.clone()));
        let rehint = spawn_fatal("rehint", crate::relay::run_rehint(state.clone(), shutdown_rx.clone()));
        let retention = spawn_fatal("retention", crate::relay::run_retention(state.clone(), shutdown_rx.clone()));
        let sweep = spawn_fatal("limits sweep", sweep_limits(state.clone(), shutdown_rx.clone()));
        let typing = spawn_fatal("typing sweep", state.lane.clone().run_sweep(shutdown_rx.clone()));
        let audit = spawn_fatal("audit retention", crate::audit::run_retention(state.clone(), shutdown_rx.clone()));
        let reconcile = spawn_fatal("reconcile", crate::reconcile::run_scheduled(state.clone(), shutdown_rx.clone()));
        let push = spawn_fatal("push", crate::push::run(state.clone(), shutdown_rx.clone()));
        let mut tasks = vec![http, relay, rehint, retention, sweep, typing, audit, reconcile, push];
        // Fences reach this node from the store (an operator's command run
        // on the store by another process; in cluster mode also what the
        // bus lost) and, in cluster mode, on the bus (`fence`).
        let cluster = bus_pending.is_some();
        if !state.config.hold_fence_refresh {
            let refresh =
                spawn_fatal("fence refresh", crate::fence::run_refresh(state.clone(), shutdown_rx.clone(), cluster));
            tasks.push(refresh);
        }
        if let Some(pending) = bus_pending {
            let to = crate::bus::Receivers {
                hub: state.hub.clone(),
                fences: state.fences.clone(),
                groups: state.groups.clone(),
                lane: state.lane.clone(),
            };
            let route_tasks =
                crate::route::Router::start(state.clone(), shutdown_rx.clone()).await.map_err(std::io::Error::other)?;
            tasks.extend(route_tasks.into_iter().map(|t| tokio::spawn(fatal_on_panic("route", t))));
            let bus_tasks = pending.spawn(to, shutdown_rx);
            tasks.extend(bus_tasks.into_iter().map(|t| tokio::spawn(fatal_on_panic("hint bus", t))));
        }
        tracing::info!(%addr, "tidemark listening");
        Ok(RunningServer { addr, state, shutdown: shutdown_tx, tasks })
    }
}

impl RunningServer {
    /// Stops accepting, ends connections and waits for the workers.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Forgets idle rate-limit keys every [`crate::limits::LIMITS_SWEEP_EVERY`],
/// so the limiters' memory follows the active callers.
async fn sweep_limits(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(crate::limits::LIMITS_SWEEP_EVERY) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
        state.limits.sweep(crate::util::now_ms());
    }
}

/// Spawns one of the server's long-lived tasks; a panic inside it aborts
/// the process (see [`fatal_on_panic`]).
fn spawn_fatal(name: &'static str, task: impl Future<Output = ()> + Send + 'static) -> JoinHandle<()> {
    tokio::spawn(fatal_on_panic(name, tokio::spawn(task)))
}

/// Awaits a long-lived task. A panic there is a broken invariant: rather
/// than run on without a relay, a sweep or a listener (answering as if
/// healthy), the process aborts, in debug builds and tests as in release
/// ones (where `panic = "abort"` already ends it at the panic).
async fn fatal_on_panic(name: &'static str, task: JoinHandle<()>) {
    if let Err(e) = task.await {
        if e.is_panic() {
            tracing::error!(task = name, "long-lived task panicked; aborting the process");
            std::process::abort();
        }
    }
}

/// Connections the kernel may queue before `accept`. tokio's default is
/// 1024; after a restart every device reconnects at once, and a full queue
/// drops SYNs, which clients retry only after 1 s, then 3 s (`tidemark
/// bench reconnect`: handshake p99 jumped from ~0.1 s to ~1.1 s at 1000
/// devices). The kernel caps it at `net.core.somaxconn`.
pub const LISTEN_BACKLOG: u32 = 8192;

/// Binds the first address `listen` resolves to, with [`LISTEN_BACKLOG`]
/// and `SO_REUSEADDR` (a restarted server rebinds its port at once).
async fn bind(listen: &str) -> std::io::Result<TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host(listen).await? {
        let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        match socket.bind(addr) {
            Ok(()) => return socket.listen(LISTEN_BACKLOG),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{listen}: no address"))))
}
