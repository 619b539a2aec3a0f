//! Accounts: the rules a user account obeys, in one place. A name is a
//! valid user id (`tidemark_core::ids::check_user`), a password is
//! 1..=[`PASSWORD_BYTES_MAX`] bytes (Argon2's cost is bounded by its input),
//! a password is stored only as an Argon2id PHC string under a random salt,
//! and a login verifies against it (or against nothing, as slowly, for a
//! name that does not exist). Hashing draws a random salt, so it lives here
//! and not in the pure core. The gateway's login and admin endpoints, the
//! CLI's `user add` and the benchmarks all go through these functions.
//! Passwords never reach a log line.

use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use tidemark_proto::ErrorCode;

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::util::now_ms;

/// Longest accepted password, in bytes (argon2 cost is bounded by input).
pub use tidemark_proto::PASSWORD_BYTES_MAX;

/// A new account's name and password, checked before anything is hashed;
/// the name in its one form (`tidemark_core::ids::canonical_user`), the
/// account's id.
pub fn check_new_account(user: &str, password: &str) -> Result<String, String> {
    let user = tidemark_core::ids::canonical_user(user)?;
    if password.is_empty() || password.len() > PASSWORD_BYTES_MAX {
        return Err(format!("password must be 1..={PASSWORD_BYTES_MAX} bytes"));
    }
    Ok(user)
}

/// The account a name from outside means (`tidemark_core::ids::resolve_user`):
/// its one form, or a legacy account created before names were folded,
/// named exactly as written. Reads the store only for a name that is not
/// in its one form. An invalid name is `BAD_REQUEST`.
pub async fn resolve_user(store: &dyn tidemark_store::Store, name: &str) -> ApiResult<String> {
    let (folded, legacy) = tidemark_core::ids::user_lookups(name).map_err(ApiError::bad_request)?;
    let Some(exact) = legacy else { return Ok(folded) };
    let folded_exists = store.password_hash(&folded).await?.is_some();
    let legacy_exists = !folded_exists && store.password_hash(&exact).await?.is_some();
    Ok(tidemark_core::ids::resolve_user(folded, Some(exact), folded_exists, legacy_exists))
}

/// The PHC string (Argon2id, default parameters, random salt) to store.
pub fn hash_password(password: &str) -> Result<String, String> {
    let salt = SaltString::generate(&mut OsRng);
    Argon2::default().hash_password(password.as_bytes(), &salt).map(|h| h.to_string()).map_err(|e| e.to_string())
}

pub fn verify_password(password: &str, phc: &str) -> bool {
    PasswordHash::new(phc).is_ok_and(|h| Argon2::default().verify_password(password.as_bytes(), &h).is_ok())
}

/// A login's verdict against the stored hash, if the user exists. Without
/// one it still hashes, so timing does not reveal which names exist.
/// Blocking (Argon2): call it off the async threads.
pub fn verify_login(password: &str, stored: Option<&str>) -> bool {
    match stored {
        Some(h) => verify_password(password, h),
        None => {
            let _ = hash_password(password);
            false
        }
    }
}

/// Creates an account (`POST /v1/admin/users`) under the name's one form,
/// which it returns with `false` when that name is taken (in any case).
pub async fn create_user(state: &AppState, user: &str, password: &str) -> ApiResult<(String, bool)> {
    let user = check_new_account(user, password).map_err(ApiError::bad_request)?;
    let password = password.to_owned();
    let hash = state
        .limits
        .hash(move || hash_password(&password))
        .await?
        .map_err(|e| ApiError::new(ErrorCode::Internal, e))?;
    let created = state.store.create_user(&user, &hash, now_ms()).await?;
    Ok((user, created))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_account_rules() {
        fn check(user: &str, password: &str, expect: bool) {
            assert_eq!(check_new_account(user, password).is_ok(), expect, "{user:?} / {} bytes", password.len());
        }
        let longest = "p".repeat(PASSWORD_BYTES_MAX);
        let too_long = "p".repeat(PASSWORD_BYTES_MAX + 1);
        check("alice", "pw", true);
        check("Alice", "pw", true);
        check("alice", &longest, true);
        check("alice", "", false);
        check("alice", &too_long, false);
        check("", "pw", false);
        check("al ice", "pw", false);
        check(&"a".repeat(tidemark_core::ids::USER_BYTES_MAX + 1), "pw", false);
    }

    #[test]
    fn a_new_account_is_named_in_its_one_form() {
        assert_eq!(check_new_account("Alice", "pw").as_deref(), Ok("alice"));
    }

    #[test]
    fn a_hash_verifies_its_password_only() {
        let h = hash_password("secret").unwrap();
        assert!(h.starts_with("$argon2id$"));
        assert_ne!(h, hash_password("secret").unwrap(), "salts are random");
        assert!(verify_password("secret", &h));
        assert!(!verify_password("Secret", &h));
        assert!(!verify_password("secret", "not a phc string"));
        assert!(verify_login("secret", Some(&h)));
        assert!(!verify_login("secret", None));
    }
}
