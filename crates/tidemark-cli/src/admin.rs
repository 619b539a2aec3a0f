//! `tidemark user list|logout|deactivate|delete|audit` and `tidemark device
//! list|revoke`: what an operator does, straight on the store (`--data` or
//! `--database`). Each action is audited with actor `admin` and no
//! address. Logins and refresh tokens see a change at once; a running
//! server's in-memory fence of ended sessions (and of revoked devices)
//! learns it at its next fence check (every second: the write moved the
//! store's `fences_version`), and then kicks the ended connections; the
//! admin endpoints are the immediate way.

use anyhow::{bail, Context, Result};
use tidemark_core::audit::{actor, event};
use tidemark_core::token::TokenKeys;
use tidemark_store::{AuditEntry, Store};

use crate::{open_store, AdminCommand, DeviceCommand, UserCommand};

/// Appends an operator's action to the audit log.
async fn audit(store: &dyn Store, event: &str, user: &str, device: Option<&str>) -> Result<()> {
    let keys = TokenKeys::from_secret(&store.server_secret().await?);
    let entry = AuditEntry {
        at_ms: tidemark_server::util::now_ms(),
        event: event.into(),
        actor: actor::ADMIN.into(),
        user_hash: keys.audit_id(user),
        device_hash: device.map(|d| keys.audit_id(d)),
        address: None,
    };
    store.append_audit(&entry).await.context("write the audit entry")?;
    Ok(())
}

/// The account a name means: its one form, or a legacy account by its
/// exact name (`tidemark_server::accounts::resolve_user`).
async fn user_name(store: &dyn tidemark_store::Store, name: &str) -> Result<String> {
    tidemark_server::accounts::resolve_user(store, name).await.map_err(|e| anyhow::anyhow!("{}", e.message))
}

pub async fn user(command: UserCommand) -> Result<()> {
    match command {
        UserCommand::Add { .. } => unreachable!("`user add` is handled by main"),
        UserCommand::List { store } => {
            let store = open_store(&store).await?;
            for u in store.list_users().await? {
                let state = match (u.deleted_at_ms, u.deactivated_at_ms) {
                    (Some(at), _) => format!("deleted {at}"),
                    (None, Some(at)) => format!("deactivated {at}"),
                    (None, None) => "active".into(),
                };
                println!("{}\t{}\t{state}", u.user, u.created_at_ms);
            }
            Ok(())
        }
        UserCommand::Logout { name, device, store } => {
            if let Some(d) = &device {
                tidemark_core::ids::check_device_id(d).map_err(anyhow::Error::msg)?;
            }
            let store = open_store(&store).await?;
            let name = user_name(&*store, &name).await?;
            if !store.end_sessions(&name, device.as_deref(), tidemark_server::util::now_ms()).await? {
                bail!("no such user or device");
            }
            audit(&*store, event::LOGGED_OUT, &name, device.as_deref()).await?;
            match device {
                Some(d) => println!("ended the sessions of {name}'s device {d}"),
                None => println!("ended every session of {name}"),
            }
            Ok(())
        }
        UserCommand::Deactivate { name, store } => {
            let store = open_store(&store).await?;
            let name = user_name(&*store, &name).await?;
            if store.deactivate_user(&name, tidemark_server::util::now_ms()).await? {
                audit(&*store, event::DEACTIVATED, &name, None).await?;
                println!("deactivated {name}");
            } else {
                println!("{name} was deactivated already");
            }
            Ok(())
        }
        UserCommand::Delete { name, store } => {
            let store = open_store(&store).await?;
            let name = user_name(&*store, &name).await?;
            if store.delete_user(&name, tidemark_server::util::now_ms()).await? {
                audit(&*store, event::DELETED, &name, None).await?;
                println!("deleted {name}");
            } else {
                println!("{name} was deleted already");
            }
            Ok(())
        }
        UserCommand::Audit { name, since_secs, limit, store } => {
            let store = open_store(&store).await?;
            let keys = TokenKeys::from_secret(&store.server_secret().await?);
            let user_hash = match name {
                Some(n) => Some(keys.audit_id(&user_name(&*store, &n).await?)),
                None => None,
            };
            let from = since_secs.map_or(0, |s| {
                tidemark_server::util::now_ms()
                    .saturating_sub(i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX))
            });
            for e in store.audit_log(user_hash.as_deref(), from, i64::MAX, limit).await? {
                println!(
                    "{}\t{}\t{}\tuser:{}\tdevice:{}\taddress:{}",
                    e.at_ms,
                    e.event,
                    e.actor,
                    e.user_hash,
                    e.device_hash.as_deref().unwrap_or("-"),
                    e.address.as_deref().unwrap_or("-")
                );
            }
            Ok(())
        }
    }
}

pub async fn device(command: DeviceCommand) -> Result<()> {
    match command {
        DeviceCommand::List { user, store } => {
            let store = open_store(&store).await?;
            let user = user_name(&*store, &user).await?;
            for d in store.list_devices(&user).await? {
                println!("{}\t{}\t{}\t{}\t{}", d.device, d.state.as_str(), d.created_at_ms, d.last_seen_ms, d.name);
            }
            Ok(())
        }
        DeviceCommand::Revoke { user, device, store } => {
            tidemark_core::ids::check_device_id(&device).map_err(anyhow::Error::msg)?;
            let store = open_store(&store).await?;
            let user = user_name(&*store, &user).await?;
            let revoked = store.revoke_device(&user, &device, tidemark_server::util::now_ms()).await?;
            audit(&*store, event::DEVICE_REVOKED, &user, Some(&device)).await?;
            if revoked {
                println!("revoked {user}'s device {device}");
            } else {
                println!("{user}'s device {device} was revoked already");
            }
            Ok(())
        }
    }
}

pub async fn admin(command: AdminCommand) -> Result<()> {
    match command {
        AdminCommand::Reconcile { dry_run, store } => {
            let store = open_store(&store).await?;
            let reply = tidemark_server::reconcile::run_once(&*store, dry_run).await.context("reconcile")?;
            println!("{}", serde_json::to_string_pretty(&reply)?);
            Ok(())
        }
    }
}
