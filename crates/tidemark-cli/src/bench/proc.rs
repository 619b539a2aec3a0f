//! The server under test as a child process: `tidemark serve` (or a
//! baseline server, this binary with a hidden flag) started from the
//! current executable, its resident set read from /proc, its `/metrics`
//! scraped. A server in its own process keeps its memory and its open
//! files apart from the benchmark's clients (10,000 connections need
//! 10,000 descriptors on each side).

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};

use super::stores::StoreAt;

/// Kills (SIGKILL) and reaps the child when dropped.
pub(super) struct ChildGuard(pub Child);

impl ChildGuard {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `<this executable> args…` and reads its first stdout line, which
/// must end with the listening address.
pub(super) fn spawn_server(args: &[&str]) -> Result<(ChildGuard, SocketAddr)> {
    // The server logs every login at info level.
    spawn_server_logging(args, "warn")
}

/// [`spawn_server`], logging at `level` unless RUST_LOG says otherwise.
pub(super) fn spawn_server_logging(args: &[&str], level: &str) -> Result<(ChildGuard, SocketAddr)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", level);
    }
    let mut child = ChildGuard(cmd.spawn()?);
    let stdout = child.0.stdout.take().context("stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    let addr = line.split_whitespace().last().with_context(|| format!("no address printed by {args:?}"))?.parse()?;
    Ok((child, addr))
}

/// `tidemark serve` on the store `at`, listening on `listen`.
pub(super) fn spawn_tidemark(at: &StoreAt, listen: &str) -> Result<(ChildGuard, SocketAddr)> {
    let store = at.serve_args();
    // Benchmarks measure the node itself: rate limits off (ten thousand
    // devices log in from a handful of loopback addresses).
    let mut args = vec!["serve", "--listen", listen, "--no-rate-limits"];
    args.extend(store.iter().map(String::as_str));
    spawn_server(&args)
}

pub(super) fn rss_kib(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:")).context("no VmRSS")?;
    Ok(line.split_whitespace().nth(1).context("VmRSS value")?.parse()?)
}

/// User plus system CPU of process `pid` (a number, or `self`) so far, in
/// clock ticks, from /proc/<pid>/stat.
pub(super) fn cpu_ticks(pid: impl std::fmt::Display) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses: state is
    // field 3, utime 14 and stime 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Clock ticks per second of /proc's CPU times (`CLK_TCK`).
pub(super) fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf only reads a system constant.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64
}

/// CPU seconds (user + system) process `pid` (a number, or `self`) used so
/// far.
pub(super) fn cpu_secs(pid: impl std::fmt::Display) -> Result<f64> {
    let ticks = cpu_ticks(&pid).with_context(|| format!("no CPU times in /proc/{pid}/stat"))?;
    Ok(ticks as f64 / clock_ticks_per_s())
}

/// The soft limit on open files, from /proc/self/limits.
pub(super) fn open_files_soft_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// The value of an unlabelled metric in a Prometheus text exposition.
/// The value of the first series of `name` (`name value`, or `name{labels}
/// value`: every series carries a `stage` label).
pub(super) fn metric_value(text: &str, name: &str) -> Option<f64> {
    metric_series(text, name).next().map(|(_, v)| v)
}

/// Every series of `name` (exactly that name) in a Prometheus text
/// exposition: its line, to look for a label in, and its value.
pub(super) fn metric_series<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines().filter_map(move |l| {
        let rest = l.strip_prefix(name)?;
        rest.starts_with([' ', '{']).then(|| Some((l, rest.rsplit(' ').next()?.parse().ok()?))).flatten()
    })
}

/// Scrapes `name` from the server's `/metrics`.
pub(super) async fn scrape(addr: SocketAddr, name: &str) -> Result<f64> {
    Ok(scrape_all(addr, &[name]).await?[0])
}

/// Scrapes every one of `names` from one read of the server's `/metrics`
/// (one consistent set of values, one request).
pub(super) async fn scrape_all(addr: SocketAddr, names: &[&str]) -> Result<Vec<f64>> {
    let text = reqwest::get(format!("http://{addr}/metrics")).await?.error_for_status()?.text().await?;
    names.iter().map(|name| metric_value(&text, name).with_context(|| format!("{name} not in /metrics"))).collect()
}

/// Writes `users` (cheap password hash, 64 at a time) into the store `at`
/// before any server starts, then closes the store.
pub(super) async fn create_users(at: &StoreAt, users: &[String], pb: &indicatif::ProgressBar) -> Result<()> {
    use futures_util::{StreamExt, TryStreamExt};
    let store = at.open().await?;
    let hash = super::device::cheap_hash()?;
    futures_util::stream::iter(users.iter().map(|u| {
        let (store, hash, pb) = (store.clone(), hash.clone(), pb.clone());
        async move {
            pb.inc(1);
            store.create_user(u, &hash, 0).await
        }
    }))
    .buffer_unordered(64)
    .try_collect::<Vec<_>>()
    .await?;
    at.close(store).await;
    Ok(())
}

/// Devices registered at once through the store during setup: enough for
/// the writer to commit them in large batches.
const SETUP_STORE_CONCURRENCY: usize = 512;

/// Access-token signing for devices set up through the store: the keys
/// derived from the store's server secret, as `tidemark serve` derives them.
pub(super) struct TokenMint(tidemark_core::token::TokenKeys);

impl TokenMint {
    /// An access token for `device` of `user`, living as long as a login's.
    pub fn access(&self, user: &str, device: &str) -> String {
        let ttl = tidemark_server::ServerConfig::default().access_token_ttl;
        let expires_at_ms = super::unix_ms() + ttl.as_millis() as i64;
        let claims = tidemark_core::token::AccessClaims { user: user.into(), device: device.into(), expires_at_ms };
        self.0.sign_access(&claims)
    }
}

/// Writes `users` (cheap password hash) and, for each, `device` as a login
/// registers it, into the store `at` before any server starts,
/// many at once so the writer batches them, then closes the store. Returns
/// the signer of their access tokens: setting up thousands of devices
/// costs no login (a password hash, a refresh token and two audit entries
/// each, one after the other), and nothing measured logs in.
pub(super) async fn create_devices(
    at: &StoreAt,
    users: &[String],
    device: &str,
    pb: &indicatif::ProgressBar,
) -> Result<TokenMint> {
    use futures_util::{StreamExt, TryStreamExt};
    let store = at.open().await?;
    let hash = super::device::cheap_hash()?;
    futures_util::stream::iter(users.iter().map(|u| {
        let (store, hash, pb) = (store.clone(), hash.clone(), pb.clone());
        async move {
            store.create_user(u, &hash, 0).await?;
            store.login_device(u, device, device, super::unix_ms()).await?;
            pb.inc(1);
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(SETUP_STORE_CONCURRENCY)
    .try_collect::<Vec<_>>()
    .await?;
    let mint = TokenMint(tidemark_core::token::TokenKeys::from_secret(&store.server_secret().await?));
    at.close(store).await;
    Ok(mint)
}

/// The value at quantile `q` of an ascending slice (0 if empty).
pub(super) fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_value_reads_the_exact_name_only() {
        let text = "# TYPE tidemark_store_statements gauge\ntidemark_store_statements 1234\n\
                    tidemark_store_statements_extra 9\ntidemark_outbox_backlog 0\n";
        assert_eq!(metric_value(text, "tidemark_store_statements"), Some(1234.0));
        assert_eq!(metric_value(text, "tidemark_outbox_backlog"), Some(0.0));
        assert_eq!(metric_value(text, "tidemark_store"), None);
        let labelled = "tidemark_outbox_backlog{stage=\"outbox\"} 7\n";
        assert_eq!(metric_value(labelled, "tidemark_outbox_backlog"), Some(7.0));
    }

    #[test]
    fn pct_picks_from_the_sorted_slice() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(pct(&xs, 0.5), 51.0);
        assert_eq!(pct(&xs, 0.99), 100.0);
        assert_eq!(pct(&[], 0.5), 0.0);
    }
}
