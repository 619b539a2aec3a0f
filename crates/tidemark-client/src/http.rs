//! HTTP calls: admin, login, refresh and `POST /v1/rpc/<op>`.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tidemark_proto::{
    AdminAuditOk, AdminAuditReq, AdminDeactivateOk, AdminDeactivateReq, AdminDeleteOk, AdminDeleteReq, AdminLogoutOk,
    AdminLogoutReq, AdminUserOk, AdminUserReq, LoginOk, LoginReq, RefreshReq,
};

use crate::{decode_reply, ClientError, ClientResult};

#[derive(Debug, Clone)]
pub struct Http {
    base: String,
    client: reqwest::Client,
}

impl Http {
    /// `base` is like `http://127.0.0.1:8080`.
    pub fn new(base: &str) -> Http {
        Http { base: base.trim_end_matches('/').to_owned(), client: reqwest::Client::new() }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        bearer: Option<&str>,
        body: &B,
    ) -> ClientResult<T> {
        let mut req = self.client.post(format!("{}{}", self.base, path)).json(body);
        if let Some(token) = bearer {
            req = req.bearer_auth(token);
        }
        let resp = req.send().await.map_err(|e| ClientError::Transport(e.to_string()))?;
        let text = resp.text().await.map_err(|e| ClientError::Decode(e.to_string()))?;
        decode_reply(&text)
    }

    pub async fn create_user(&self, admin_token: &str, user: &str, password: &str) -> ClientResult<AdminUserOk> {
        let body = AdminUserReq { user: user.into(), password: password.into() };
        self.post("/v1/admin/users", Some(admin_token), &body).await
    }

    /// `POST /v1/admin/logout`: ends the sessions of `user`, or of one device.
    pub async fn admin_logout(
        &self,
        admin_token: &str,
        user: &str,
        device_id: Option<&str>,
    ) -> ClientResult<AdminLogoutOk> {
        let body = AdminLogoutReq { user: user.into(), device_id: device_id.map(str::to_owned) };
        self.post("/v1/admin/logout", Some(admin_token), &body).await
    }

    /// `POST /v1/admin/deactivate`: every session of `user` ends for good.
    pub async fn admin_deactivate(&self, admin_token: &str, user: &str) -> ClientResult<AdminDeactivateOk> {
        self.post("/v1/admin/deactivate", Some(admin_token), &AdminDeactivateReq { user: user.into() }).await
    }

    /// `POST /v1/admin/delete`: deletes `user` (devices, log, cursors).
    pub async fn admin_delete(&self, admin_token: &str, user: &str) -> ClientResult<AdminDeleteOk> {
        self.post("/v1/admin/delete", Some(admin_token), &AdminDeleteReq { user: user.into() }).await
    }

    /// `POST /v1/admin/audit`: audit entries by user and time range.
    pub async fn admin_audit(&self, admin_token: &str, req: &AdminAuditReq) -> ClientResult<AdminAuditOk> {
        self.post("/v1/admin/audit", Some(admin_token), req).await
    }

    pub async fn login(&self, user: &str, password: &str, device_id: &str) -> ClientResult<LoginOk> {
        let body = LoginReq {
            user: user.into(),
            password: password.into(),
            device_id: device_id.into(),
            device_name: Some(device_id.into()),
        };
        self.post("/v1/login", None, &body).await
    }

    pub async fn refresh(&self, refresh_token: &str) -> ClientResult<LoginOk> {
        self.post("/v1/refresh", None, &RefreshReq { refresh_token: refresh_token.into() }).await
    }

    /// `POST /v1/rpc/<op>` with `body`; decodes the `<op>.ok` reply.
    pub async fn rpc<B: Serialize, T: DeserializeOwned>(&self, token: &str, op: &str, body: &B) -> ClientResult<T> {
        self.post(&format!("/v1/rpc/{op}"), Some(token), body).await
    }
}
