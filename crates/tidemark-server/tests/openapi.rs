//! `/v1/openapi.json` against the real server: every operation of
//! `op::ALL` is in it, and real replies (successes and refusals, HTTP and
//! WebSocket frames) validate against its schemas: types, required fields,
//! bounds, and no field the document does not declare.

mod common;

use common::*;
use futures_util::StreamExt;
use jsonschema::Draft;
use serde_json::{json, Value};
use tidemark_client::proto::{op, ErrorCode};
use tidemark_server::ServerConfig;

/// The served document, and the checks of a reply against it.
struct Doc(Value);

fn escape(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

impl Doc {
    async fn fetch(base: &str) -> Doc {
        Doc(reqwest::get(format!("{base}/v1/openapi.json")).await.unwrap().json().await.unwrap())
    }

    fn resolve<'a>(&'a self, schema: &'a Value) -> &'a Value {
        match schema.get("$ref").and_then(Value::as_str) {
            Some(r) => self.resolve(self.0.pointer(r.trim_start_matches('#')).unwrap_or_else(|| panic!("{r}"))),
            None => schema,
        }
    }

    /// Whether `value` validates against the schema at `pointer`.
    fn validate(&self, pointer: &str, value: &Value) -> Result<(), String> {
        let mut root = self.0.clone();
        root["$ref"] = Value::String(format!("#{pointer}"));
        let validator = jsonschema::options().with_draft(Draft::Draft202012).build(&root).map_err(|e| e.to_string())?;
        let errors: Vec<String> =
            validator.iter_errors(value).map(|e| format!("{} at {}", e, e.instance_path())).collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    fn valid_inline(&self, schema: &Value, value: &Value) -> bool {
        let mut root = self.0.clone();
        for (k, v) in schema.as_object().into_iter().flatten() {
            root[k] = v.clone();
        }
        jsonschema::options().with_draft(Draft::Draft202012).build(&root).is_ok_and(|v| v.is_valid(value))
    }

    /// Fields of `value` that `schema` does not declare (JSON Schema lets
    /// them through; the document must not leave any reply field out).
    fn undeclared(&self, schema: &Value, value: &Value, at: &str, out: &mut Vec<String>) {
        let schema = self.resolve(schema);
        match value {
            Value::Object(fields) => {
                let mut props = serde_json::Map::new();
                let mut extra: Option<Value> = None;
                let mut declared = false;
                self.collect(schema, value, &mut props, &mut extra, &mut declared);
                if !declared {
                    return; // a free-form object: message content, event data
                }
                for (k, v) in fields {
                    let here = format!("{at}.{k}");
                    match (props.get(k), &extra) {
                        (Some(s), _) => self.undeclared(s, v, &here, out),
                        (None, Some(s)) => self.undeclared(s, v, &here, out),
                        (None, None) => out.push(here),
                    }
                }
            }
            Value::Array(items) => {
                let mut item_schemas = Vec::new();
                self.items(schema, value, &mut item_schemas);
                for (i, v) in items.iter().enumerate() {
                    for s in &item_schemas {
                        self.undeclared(s, v, &format!("{at}[{i}]"), out);
                    }
                }
            }
            _ => {}
        }
    }

    fn collect(
        &self,
        schema: &Value,
        value: &Value,
        props: &mut serde_json::Map<String, Value>,
        extra: &mut Option<Value>,
        declared: &mut bool,
    ) {
        let schema = self.resolve(schema);
        if let Some(p) = schema.get("properties").and_then(Value::as_object) {
            *declared = true;
            props.extend(p.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        if let Some(a) = schema.get("additionalProperties") {
            *declared = true;
            if a.is_object() {
                *extra = Some(a.clone());
            }
        }
        for s in schema.get("allOf").and_then(Value::as_array).into_iter().flatten() {
            self.collect(s, value, props, extra, declared);
        }
        for key in ["oneOf", "anyOf"] {
            for s in schema.get(key).and_then(Value::as_array).into_iter().flatten() {
                if self.valid_inline(self.resolve(s), value) {
                    self.collect(s, value, props, extra, declared);
                }
            }
        }
    }

    fn items(&self, schema: &Value, value: &Value, out: &mut Vec<Value>) {
        let schema = self.resolve(schema);
        if let Some(i) = schema.get("items") {
            out.push(i.clone());
        }
        for key in ["allOf", "oneOf", "anyOf"] {
            for s in schema.get(key).and_then(Value::as_array).into_iter().flatten() {
                if key == "allOf" || self.valid_inline(self.resolve(s), value) {
                    self.items(s, value, out);
                }
            }
        }
    }

    /// Checks a reply of `method path` with `status` against the document.
    fn check_at(&self, pointer: &str, value: &Value) -> Result<(), String> {
        self.validate(pointer, value)?;
        let schema = self.0.pointer(pointer).ok_or_else(|| format!("{pointer} is not in the document"))?;
        let mut out = Vec::new();
        self.undeclared(schema, value, "$", &mut out);
        if out.is_empty() {
            Ok(())
        } else {
            Err(format!("fields the document does not declare: {out:?}"))
        }
    }

    fn check(&self, method: &str, path: &str, status: u16, value: &Value) -> Result<(), String> {
        let pointer = format!("/paths/{}/{method}/responses/{status}/content/application~1json/schema", escape(path));
        if self.0.pointer(&pointer).is_none() {
            return Err(format!("{method} {path} does not document status {status}"));
        }
        self.check_at(&pointer, value).map_err(|e| format!("{method} {path} {status}: {e}: {value}"))
    }
}

/// Calls the real server over HTTP and checks every reply it gets.
struct Probe<'a> {
    doc: &'a Doc,
    base: String,
    http: reqwest::Client,
    checked: Vec<(String, u16)>,
}

impl Probe<'_> {
    async fn post(&mut self, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
        let mut req = self.http.post(format!("{}{path}", self.base)).json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let value: Value = resp.json().await.unwrap();
        self.doc.check("post", path, status, &value).unwrap();
        self.checked.push((path.to_owned(), status));
        (status, value)
    }

    async fn rpc(&mut self, token: &str, op: &str, body: Value) -> Value {
        let (status, v) = self.post(&format!("/v1/rpc/{op}"), Some(token), body).await;
        assert_eq!(status, 200, "{op}: {v}");
        v
    }

    async fn refused(&mut self, token: Option<&str>, op: &str, body: Value, code: ErrorCode) {
        let (status, v) = self.post(&format!("/v1/rpc/{op}"), token, body).await;
        assert_eq!(status, code.http_status(), "{op}: {v}");
        assert_eq!(v["code"], code.as_str(), "{op}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_is_documented_with_every_status() {
    let ts = TestServer::start().await;
    let doc = Doc::fetch(&ts.running().url()).await;
    assert_eq!(doc.0["openapi"], "3.1.0");
    for &name in op::ALL {
        let post = &doc.0["paths"][format!("/v1/rpc/{name}")]["post"];
        assert!(post.is_object(), "{name} is not in the document");
        let body = &post["requestBody"]["content"]["application/json"]["schema"];
        assert!(body.is_object(), "{name} has no request schema");
        let ok = &post["responses"]["200"]["content"]["application/json"]["schema"];
        assert!(ok.is_object(), "{name} has no reply schema");
        for status in ErrorCode::http_statuses() {
            assert!(post["responses"][status.to_string()].is_object(), "{name} does not document {status}");
        }
        assert_eq!(post["security"], json!([{"bearer": []}]), "{name}");
    }
    // Request bounds come from the named proto bounds.
    let schemas = &doc.0["components"]["schemas"];
    assert_eq!(schemas["SendReq"]["properties"]["conv"]["maxLength"], tidemark_client::proto::ID_BYTES_MAX);
    assert_eq!(
        schemas["SendReq"]["properties"]["client_msg_id"]["maxLength"],
        tidemark_client::proto::CLIENT_MSG_ID_BYTES_MAX
    );
    assert_eq!(schemas["SyncReq"]["properties"]["limit"]["maximum"], tidemark_client::proto::SYNC_LIMIT_MAX);
    assert_eq!(schemas["SendReq"]["required"], json!(["conv", "client_msg_id", "content"]));
    // The WebSocket route documents its refusal of a plain GET.
    let ws = &doc.0["paths"]["/v1/ws"]["get"]["responses"];
    for status in ["101", "400", "401", "403"] {
        assert!(ws[status].is_object(), "/v1/ws does not document {status}");
    }
    let plain = reqwest::get(format!("{}/v1/ws", ts.running().url())).await.unwrap();
    assert_eq!(plain.status().as_u16(), 400);
    let v: Value = plain.json().await.unwrap();
    doc.check("get", "/v1/ws", 400, &v).unwrap();
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_replies_validate_against_the_document() {
    // A low large-group threshold, so the group below switches to shared
    // mode and conv.list, sync and dirty.clear show their marker fields.
    let policy = tidemark_core::large::GroupPolicy::new(2).unwrap();
    // A webhook provider (nobody listens: only registration is checked).
    let webhook = tidemark_push::webhook::Webhook::new("http://127.0.0.1:9/hook", b"k".to_vec());
    let push = tidemark_server::push::PushConfig {
        providers: vec![std::sync::Arc::new(webhook)],
        ..tidemark_server::push::PushConfig::default()
    };
    let ts = TestServer::start_with(ServerConfig { group_policy: policy, push, ..ServerConfig::default() }).await;
    let base = ts.running().url();
    let doc = Doc::fetch(&base).await;
    let mut p = Probe { doc: &doc, base: base.clone(), http: reqwest::Client::new(), checked: Vec::new() };

    for user in ["ann", "ben", "cat"] {
        p.post("/v1/admin/users", Some(ADMIN), json!({"user": user, "password": PASSWORD})).await;
    }
    let (_, login) =
        p.post("/v1/login", None, json!({"user": "ann", "password": PASSWORD, "device_id": "phone"})).await;
    let (_, login) = p.post("/v1/refresh", None, json!({"refresh_token": login["refresh_token"]})).await;
    let ann = login["access_token"].as_str().unwrap().to_owned();
    let (_, ben_login) = p
        .post("/v1/login", None, json!({"user": "ben", "password": PASSWORD, "device_id": "tab", "device_name": "T"}))
        .await;
    let ben = ben_login["access_token"].as_str().unwrap().to_owned();
    let (status, _) = p.post("/v1/login", None, json!({"user": "ann", "password": "wrong", "device_id": "x"})).await;
    assert_eq!(status, 401);

    // A WebSocket of ben's, to see the frames the server pushes.
    let mut req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(format!(
        "ws://{}/v1/ws",
        ts.running().addr
    ))
    .unwrap();
    req.headers_mut().insert("authorization", format!("Bearer {ben}").parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();

    let direct = p.rpc(&ann, op::CONV_CREATE, json!({"kind": "direct", "members": ["ben"]})).await;
    let conv = direct["conv"].as_str().unwrap().to_owned();
    let sent =
        p.rpc(&ann, op::SEND, json!({"conv": conv, "client_msg_id": "m1", "content": {"text": "hi", "n": 1.5}})).await;
    let mid = sent["message_id"].as_str().unwrap().to_owned();
    p.rpc(&ann, op::SEND, json!({"conv": conv, "client_msg_id": "m1", "content": {"text": "hi"}})).await;
    p.rpc(
        &ann,
        op::SEND,
        json!({"conv": conv, "client_msg_id": "m2", "kind": "text", "content": {"text": "re", "quote": {"message_id": mid}}}),
    )
    .await;
    let hint = loop {
        let frame =
            tokio::time::timeout(std::time::Duration::from_secs(10), ws.next()).await.unwrap().unwrap().unwrap();
        if let tokio_tungstenite::tungstenite::Message::Text(t) = frame {
            break serde_json::from_str::<Value>(&t).unwrap();
        }
    };
    assert_eq!(hint["t"], "hint");
    doc.check_at("/components/schemas/ServerFrame", &hint).unwrap();

    let reacted = p.rpc(&ben, op::REACT, json!({"conv": conv, "message_id": mid, "reaction": "👍", "op": "add"})).await;
    let base_version = reacted["version"].clone();
    p.rpc(
        &ann,
        op::EDIT,
        json!({"conv": conv, "message_id": mid, "content": {"text": "hi!"}, "base_version": base_version}),
    )
    .await;
    p.rpc(&ben, op::CONV_SETTINGS, json!({"conv": conv, "muted": true})).await;
    let set = p.rpc(&ben, op::CONV_SETTINGS, json!({"conv": conv, "push_preview": "conversation"})).await;
    assert_eq!(set["push_preview"], "conversation");
    let wrong = json!({"conv": conv, "push_preview": "everything"});
    p.refused(Some(&ben), op::CONV_SETTINGS, wrong, ErrorCode::BadRequest).await;
    p.rpc(&ben, op::DELIVERY_ACK, json!({"message_ids": [mid]})).await;
    let receipts = p.rpc(&ann, op::DELIVERY_RECEIPTS, json!({"conv": conv, "message_ids": [mid]})).await;
    assert!(receipts["receipts"][0]["delivered_at"].is_i64(), "{receipts}");
    p.rpc(&ann, op::CONV_RECEIPTS, json!({"conv": conv, "msg_seq": 1})).await;
    p.rpc(&ann, op::TYPING, json!({"conv": conv, "typing": true, "timeout_ms": 2000})).await;
    let typing = loop {
        let frame =
            tokio::time::timeout(std::time::Duration::from_secs(10), ws.next()).await.unwrap().unwrap().unwrap();
        if let tokio_tungstenite::tungstenite::Message::Text(t) = frame {
            let v = serde_json::from_str::<Value>(&t).unwrap();
            if v["t"] == "typing" {
                break v;
            }
        }
    };
    doc.check_at("/components/schemas/ServerFrame", &typing).unwrap();
    // The opt-in frame of issue 19, as a connection that asked for it reads it.
    let batch = json!({"t": "presence.batch", "presence": [{"user": "ann", "state": "online"},
                       {"user": "cat", "state": "idle", "last_seen": 5}]});
    doc.check_at("/components/schemas/ServerFrame", &batch).unwrap();
    assert!(doc.check_at("/components/schemas/ServerFrame", &json!({"t": "presence.batch"})).is_err());
    p.rpc(&ben, op::PRIVACY_SET, json!({})).await;
    p.rpc(&ben, op::PRIVACY_SET, json!({"private_receipts": true})).await;
    let mine = p.rpc(&ben, op::PRIVACY_SET, json!({"push_preview": "none"})).await;
    assert_eq!(mine["push_preview"], "none");
    p.refused(Some(&ben), op::PRIVACY_SET, json!({"push_preview": 3}), ErrorCode::BadRequest).await;
    // Presence belongs to a WebSocket connection: ben's device has one, so
    // the call applies to it; ann's has none and is refused.
    p.rpc(&ben, op::PRESENCE_SET, json!({"state": "idle"})).await;
    p.refused(Some(&ann), op::PRESENCE_SET, json!({"state": "idle"}), ErrorCode::BadRequest).await;
    p.rpc(&ben, op::MESSAGE_DELETE, json!({"conv": conv, "message_id": mid})).await;
    let group = p.rpc(&ann, op::CONV_CREATE, json!({"kind": "group", "members": ["ben"], "client_msg_id": "g1"})).await;
    let gconv = group["conv"].as_str().unwrap().to_owned();
    p.rpc(&ann, op::CONV_ADD, json!({"conv": gconv, "user": "cat"})).await;
    let members = p.rpc(&ben, op::CONV_MEMBERS, json!({"conv": gconv, "limit": 2})).await;
    assert_eq!((members["has_more"].as_bool(), members["next_after"].as_str()), (Some(true), Some("ben")), "{members}");
    p.rpc(&ben, op::CONV_MEMBERS, json!({"conv": gconv, "after": "ben"})).await;
    p.rpc(&ann, op::CONV_MEMBERS, json!({"conv": conv})).await;
    let stats = p.rpc(&ann, op::CLIENT_STATS, json!({"gaps_detected": 1, "repairs_pending": 99_999_999})).await;
    assert_eq!(stats["repairs_pending"], tidemark_client::proto::CLIENT_STATS_COUNT_MAX, "clamped: {stats}");
    p.refused(Some(&ann), op::CLIENT_STATS, json!({"gaps_detected": -1}), ErrorCode::BadRequest).await;
    p.rpc(&ann, op::CONV_REMOVE, json!({"conv": gconv, "user": "cat"})).await;
    p.rpc(&ben, op::CONV_LEAVE, json!({"conv": gconv})).await;
    p.refused(Some(&ben), op::CONV_MEMBERS, json!({"conv": gconv}), ErrorCode::NotMember).await;
    p.refused(Some(&ben), op::CONV_MEMBERS, json!({"conv": "nope"}), ErrorCode::NotFound).await;
    p.refused(Some(&ann), op::CONV_MEMBERS, json!({"conv": gconv, "limit": 501}), ErrorCode::BadRequest).await;
    p.rpc(&ann, op::RECALL, json!({"conv": conv, "message_id": mid})).await;

    // ben's log now holds messages, membership, control and per-user events.
    let mut first = p.rpc(&ben, op::SYNC, json!({"limit": 3})).await;
    let kinds = loop {
        let token = first["batch_token"].clone();
        if !first["has_more"].as_bool().unwrap() {
            break first["events"].as_array().unwrap().len();
        }
        first = p.rpc(&ben, op::SYNC, json!({"batch_token": token, "cursor": first["next_cursor"], "limit": 3})).await;
    };
    assert!(kinds > 0);
    p.rpc(&ben, op::READ, json!({"conv": conv, "read_to_seq": 2})).await;
    // The relay fans out asynchronously: poll (bounded) until every kind of
    // event is in ben's log.
    let kinds = ["message", "membership", "recall", "edit", "reaction", "settings", "delete"];
    let mut polls = 0;
    let all = loop {
        let all = p.rpc(&ben, op::SYNC, json!({"sync_generation": first["sync_generation"]})).await;
        let events = all["events"].as_array().unwrap();
        let missing: Vec<&str> = kinds.into_iter().filter(|k| !events.iter().any(|e| e["kind"] == *k)).collect();
        if missing.is_empty() {
            break all;
        }
        polls += 1;
        assert!(polls < 250, "events never arrived: {missing:?} in {events:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let events = all["events"].as_array().unwrap();
    let last = events.last().unwrap()["sync_seq"].clone();
    p.rpc(&ben, op::ACK, json!({"batch_token": all["batch_token"], "sync_seq": last})).await;
    p.rpc(&ben, op::CONV_LIST, json!({})).await;
    let listed = p.rpc(&ann, op::CONV_LIST, json!({})).await;
    let first = p.rpc(&ann, op::CONV_LIST, json!({"limit": 1})).await;
    assert_eq!((first["has_more"].as_bool(), first["conversations"].as_array().map(Vec::len)), (Some(true), Some(1)));
    let last = p.rpc(&ann, op::CONV_LIST, json!({"limit": 1, "after": first["next_after"]})).await;
    assert_eq!(last["has_more"], false, "{last}");
    let shared = listed["conversations"].as_array().unwrap().iter().find(|c| c["conv"] == gconv.as_str()).unwrap();
    assert_eq!(shared["mode"], "shared", "{shared}");
    let clear = json!({"conv": gconv, "dirty_version": shared["dirty_version"], "last_msg_seq": shared["dirty_target_msg_seq"]});
    let cleared = p.rpc(&ann, op::DIRTY_CLEAR, clear).await;
    assert_eq!(cleared["cleared"], true, "{cleared}");
    p.rpc(&ben, op::CONV_SYNC, json!({"conv": conv, "after": 0, "limit": 2})).await;
    p.rpc(&ben, op::HISTORY, json!({"conv": conv})).await;
    p.rpc(&ann, op::HISTORY, json!({"conv": conv, "before_seq": 2, "limit": 1})).await;
    p.rpc(&ben, op::PING, json!({})).await;

    let begin = p.rpc(&ben, op::SNAPSHOT_BEGIN, json!({})).await;
    let page = p.rpc(&ben, op::SNAPSHOT_PAGE, json!({"snapshot_token": begin["snapshot_token"], "page": 0})).await;
    assert!(page["items"].as_array().unwrap().iter().any(|i| i["type"] == "message"));
    p.rpc(&ben, op::SNAPSHOT_ACK, json!({"snapshot_token": begin["snapshot_token"]})).await;

    p.post("/v1/admin/conv/epoch", Some(ADMIN), json!({"conv": conv})).await;
    p.post("/v1/admin/unread/rebuild", Some(ADMIN), json!({})).await;

    // Refusals, each with its code and status.
    p.refused(None, op::PING, json!({}), ErrorCode::Unauthenticated).await;
    p.refused(Some(&ann), op::SEND, json!({"conv": conv}), ErrorCode::BadRequest).await;
    p.refused(Some(&ann), op::SEND, json!({"conv": "nope", "client_msg_id": "x", "content": {}}), ErrorCode::NotFound)
        .await;
    p.refused(Some(&ann), op::CONV_SYNC, json!({"conv": conv, "after": 99}), ErrorCode::CursorAhead).await;
    p.refused(Some(&ann), op::ACK, json!({"batch_token": "forged", "sync_seq": 1}), ErrorCode::TokenInvalid).await;
    let cat = cat_token(&mut p).await;
    p.refused(Some(&cat), op::HISTORY, json!({"conv": conv}), ErrorCode::NotMember).await;
    p.refused(Some(&ann), op::SYNC, json!({"sync_generation": 999}), ErrorCode::ResetRequired).await;
    let (status, v) = p.post("/v1/rpc/ping", Some(&ann), json!({"pad": "x".repeat(300 * 1024)})).await;
    assert_eq!((status, v["code"].as_str()), (413, Some("BAD_REQUEST")));
    p.rpc(&ann, op::DEVICE_LIST, json!({})).await;
    let target = json!({"platform": "webhook", "token": "tok-1234", "app_id": "a", "preview": "full"});
    p.rpc(&ann, op::PUSH_REGISTER, target).await;
    p.rpc(&ann, op::PUSH_LIST, json!({})).await;
    p.rpc(&ann, op::PUSH_REMOVE, json!({})).await;
    p.refused(Some(&ann), op::PUSH_REGISTER, json!({"platform": "gateway", "token": "t"}), ErrorCode::BadRequest).await;
    p.rpc(&ann, op::ACCOUNT_PASSWORD, json!({"old_password": PASSWORD, "new_password": PASSWORD})).await;
    p.post("/v1/admin/logout", Some(ADMIN), json!({"user": "cat", "device_id": "cat-phone"})).await;
    p.post("/v1/admin/logout", Some(ADMIN), json!({"user": "cat"})).await;
    p.post("/v1/admin/deactivate", Some(ADMIN), json!({"user": "cat"})).await;
    p.post("/v1/admin/delete", Some(ADMIN), json!({"user": "cat"})).await;
    p.post("/v1/admin/audit", Some(ADMIN), json!({"user": "cat", "limit": 10})).await;
    p.post("/v1/admin/audit", Some(ADMIN), json!({})).await;
    p.rpc(&ann, op::DEVICE_REVOKE, json!({"device_id": "phone"})).await;
    p.refused(Some(&ann), op::PING, json!({}), ErrorCode::DeviceRevoked).await;

    let health: Value = reqwest::get(format!("{base}/healthz")).await.unwrap().json().await.unwrap();
    doc.check("get", "/healthz", 200, &health).unwrap();

    let ops: std::collections::BTreeSet<&str> =
        p.checked.iter().filter_map(|(path, _)| path.strip_prefix("/v1/rpc/")).collect();
    for &name in op::ALL {
        assert!(ops.contains(name), "no reply of {name} was checked");
    }
    ts.stop().await;
}

async fn cat_token(p: &mut Probe<'_>) -> String {
    let (_, login) =
        p.post("/v1/login", None, json!({"user": "cat", "password": PASSWORD, "device_id": "cat-phone"})).await;
    login["access_token"].as_str().unwrap().to_owned()
}

/// The checks above can fail: a reply field the document leaves out, or
/// one of another type, is caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_the_document_does_not_describe_is_caught() {
    let ts = TestServer::start().await;
    let doc = Doc::fetch(&ts.running().url()).await;
    let reply =
        json!({"t": "send.ok", "message_id": "m1", "conv": "c1", "msg_seq": 1, "created_at": 5, "duplicate": false});
    doc.check("post", "/v1/rpc/send", 200, &reply).unwrap();

    let mut missing = Doc(doc.0.clone());
    missing.0["components"]["schemas"]["SendOk"]["properties"].as_object_mut().unwrap().remove("duplicate");
    let err = missing.check("post", "/v1/rpc/send", 200, &reply).unwrap_err();
    assert!(err.contains("$.duplicate"), "{err}");

    let mut retyped = Doc(doc.0.clone());
    retyped.0["components"]["schemas"]["SendOk"]["properties"]["msg_seq"] = json!({"type": "string"});
    assert!(retyped.check("post", "/v1/rpc/send", 200, &reply).is_err());

    let nested = json!({"t": "conv.list.ok", "conversations": [{"conv": "c", "kind": "direct", "last_msg_seq": 0,
        "read_seq": 0, "unread": 0, "muted": false, "pinned": false, "active": true, "surprise": 1}]});
    let err = doc.check("post", "/v1/rpc/conv.list", 200, &nested).unwrap_err();
    assert!(err.contains("$.conversations[0].surprise"), "{err}");
    assert!(doc.check("post", "/v1/rpc/send", 418, &reply).unwrap_err().contains("does not document"));
    ts.stop().await;
}
