//! `GET /v1/openapi.json`: the OpenAPI 3.1 document of the HTTP surface,
//! generated from the `tidemark-proto` types (their `ToSchema` derives, with
//! the bounds named in that crate) by utoipa.
//!
//! Every operation of [`op::ALL`] is `POST /v1/rpc/<op>` with its request
//! and `<op>.ok` reply; every route answers each HTTP status that some
//! [`ErrorCode`] maps to with an [`ErrorFrame`]. `/v1/ws` is described as
//! the upgrade it is, with the statuses it refuses an upgrade with; its
//! frames are in `components.schemas` (`ServerFrame`, `AuthReq`, `AuthOk`).

use std::borrow::Cow;
use std::sync::OnceLock;

use axum::Json;
use tidemark_proto::push::{PushListOk, PushRegisterOk, PushRegisterReq, PushRemoveOk, PushRemoveReq};
use tidemark_proto::*;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn, PathItem, PathsBuilder};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::schema::{
    AllOfBuilder, AnyOfBuilder, ArrayBuilder, ComponentsBuilder, ObjectBuilder, OneOfBuilder, Schema, Type,
};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    Content, InfoBuilder, OpenApi, OpenApiBuilder, Ref, RefOr, Required, ResponseBuilder, ResponsesBuilder,
};
use utoipa::{PartialSchema, ToSchema};

const JSON: &str = "application/json";
/// Security scheme of a device access token.
const BEARER: &str = "bearer";
/// Security scheme of the admin token.
const ADMIN: &str = "admin";

/// The request and reply of one operation of [`op::ALL`].
struct Rpc {
    op: &'static str,
    summary: &'static str,
    request: RefOr<Schema>,
    /// False for operations without fields: an empty body is `{}`.
    body_required: bool,
    reply: RefOr<Schema>,
}

/// Collects the component schemas every reference points to.
#[derive(Default)]
struct Schemas(Vec<(String, RefOr<Schema>)>);

impl Schemas {
    /// Registers `T` (and what it refers to) and returns a reference to it.
    fn of<T: ToSchema>(&mut self) -> RefOr<Schema> {
        self.named(T::name(), T::schema());
        T::schemas(&mut self.0);
        Ref::from_schema_name(T::name()).into()
    }

    fn named(&mut self, name: Cow<'static, str>, schema: RefOr<Schema>) {
        if !self.0.iter().any(|(n, _)| *n == name) {
            self.0.push((name.into_owned(), schema));
        }
    }
}

/// `conv.add` and `conv.remove` take a [`ConvMemberReq`] whose `user` is
/// required (`conv.leave` applies to the caller).
fn member_with_user(schemas: &mut Schemas) -> RefOr<Schema> {
    schemas.of::<ConvMemberReq>();
    let mut schema = ConvMemberReq::schema();
    if let RefOr::T(Schema::Object(object)) = &mut schema {
        object.required.push("user".into());
    }
    schemas.named("ConvMemberUserReq".into(), schema);
    Ref::from_schema_name("ConvMemberUserReq").into()
}

/// `sync`: a `cursor` comes with the `batch_token` of its batch (a first
/// page has neither).
fn sync_req(schemas: &mut Schemas) -> RefOr<Schema> {
    let first_page = ObjectBuilder::new().property("cursor", ObjectBuilder::new().schema_type(Type::Null));
    let next_page = ObjectBuilder::new()
        .property("batch_token", ObjectBuilder::new().schema_type(Type::String))
        .required("batch_token");
    let pages = AnyOfBuilder::new().item(first_page).item(next_page);
    AllOfBuilder::new().item(schemas.of::<SyncReq>()).item(pages).into()
}

/// `conv.create`: a direct conversation names its one peer in `members`
/// (with or without the caller); a group names any members.
fn conv_create_req(schemas: &mut Schemas) -> RefOr<Schema> {
    let kind = |k: &str| ObjectBuilder::new().schema_type(Type::String).enum_values(Some([k]));
    let peer = ArrayBuilder::new().items(tidemark_proto::openapi::user()).min_items(Some(1)).max_items(Some(1));
    let direct = ObjectBuilder::new().property("kind", kind("direct")).property("members", peer);
    let group = ObjectBuilder::new().property("kind", kind("group"));
    let kinds = OneOfBuilder::new().item(direct).item(group);
    AllOfBuilder::new().item(schemas.of::<ConvCreateReq>()).item(kinds).into()
}

fn rpcs(s: &mut Schemas) -> Vec<Rpc> {
    fn rpc(op: &'static str, summary: &'static str, request: RefOr<Schema>, reply: RefOr<Schema>) -> Rpc {
        Rpc { op, summary, request, body_required: true, reply }
    }
    let empty = s.of::<Empty>();
    let no_fields = |op: &'static str, summary: &'static str, reply: RefOr<Schema>| Rpc {
        op,
        summary,
        request: empty.clone(),
        body_required: false,
        reply,
    };
    vec![
        rpc(op::SEND, "Send a message (S1-S4)", s.of::<SendReq>(), s.of::<SendOk>()),
        rpc(op::SYNC, "Pull a page of the user sync log (D1-D5)", sync_req(s), s.of::<SyncOk>()),
        rpc(op::ACK, "Cumulative sync ACK (D4)", s.of::<AckReq>(), s.of::<AckOk>()),
        rpc(op::CONV_CREATE, "Create a conversation (G1)", conv_create_req(s), s.of::<ConvCreateOk>()),
        Rpc {
            op: op::CONV_LIST,
            summary: "Conversations with unread (R2); paged with limit or after",
            request: s.of::<ConvListReq>(),
            body_required: false,
            reply: s.of::<ConvListOk>(),
        },
        rpc(op::CONV_ADD, "Add a member to a group (G1)", member_with_user(s), s.of::<ConvMemberOk>()),
        rpc(op::CONV_REMOVE, "Remove a member (owner only, G1)", member_with_user(s), s.of::<ConvMemberOk>()),
        rpc(op::CONV_LEAVE, "Leave a group (G1)", s.of::<ConvMemberReq>(), s.of::<ConvMemberOk>()),
        rpc(op::CONV_SYNC, "Per-conversation incremental sync (C1-C2)", s.of::<ConvSyncReq>(), s.of::<ConvSyncOk>()),
        rpc(op::HISTORY, "History backwards by before_seq (C3)", s.of::<HistoryReq>(), s.of::<HistoryOk>()),
        rpc(op::RECALL, "Recall a message (E1)", s.of::<RecallReq>(), s.of::<RecallOk>()),
        rpc(op::EDIT, "Edit a message (E2)", s.of::<EditReq>(), s.of::<EditOk>()),
        rpc(op::REACT, "Add or remove a reaction (E2)", s.of::<ReactReq>(), s.of::<ReactOk>()),
        rpc(op::CONV_SETTINGS, "Mute or pin for the caller (E3)", s.of::<ConvSettingsReq>(), s.of::<ConvSettingsOk>()),
        rpc(op::READ, "Move the read cursor (R1-R3)", s.of::<ReadReq>(), s.of::<ReadOk>()),
        rpc(op::DELIVERY_ACK, "Record per-device delivery (R1)", s.of::<DeliveryAckReq>(), s.of::<DeliveryAckOk>()),
        rpc(
            op::MESSAGE_DELETE,
            "Delete a message for the caller only (E3)",
            s.of::<MessageDeleteReq>(),
            s.of::<MessageDeleteOk>(),
        ),
        rpc(
            op::DIRTY_CLEAR,
            "Clear a large group's dirty marker: a version CAS after the pull (G2)",
            s.of::<DirtyClearReq>(),
            s.of::<DirtyClearOk>(),
        ),
        no_fields(op::SNAPSHOT_BEGIN, "Build a snapshot at a frozen base (D7)", s.of::<SnapshotBeginOk>()),
        rpc(op::SNAPSHOT_PAGE, "One page of a snapshot (D7)", s.of::<SnapshotPageReq>(), s.of::<SnapshotPageOk>()),
        rpc(
            op::SNAPSHOT_ACK,
            "Install a snapshot: the cursor moves to its base (D7)",
            s.of::<SnapshotAckReq>(),
            s.of::<SnapshotAckOk>(),
        ),
        rpc(op::DEVICE_REVOKE, "Revoke a device (P5)", s.of::<DeviceRevokeReq>(), s.of::<DeviceRevokeOk>()),
        no_fields(op::DEVICE_LIST, "The caller's devices (P5)", s.of::<DeviceListOk>()),
        rpc(
            op::ACCOUNT_PASSWORD,
            "Change the caller's password; the other devices can no longer refresh (P1)",
            s.of::<AccountPasswordReq>(),
            s.of::<AccountPasswordOk>(),
        ),
        no_fields(op::PING, "Liveness of the caller's session", empty.clone()),
        rpc(op::TYPING, "Start or stop typing in a conversation (ephemeral)", s.of::<TypingReq>(), s.of::<TypingOk>()),
        rpc(
            op::PRESENCE_SET,
            "Set this connection online or idle (ephemeral; WebSocket only)",
            s.of::<PresenceSetReq>(),
            s.of::<PresenceSetOk>(),
        ),
        Rpc {
            op: op::PRIVACY_SET,
            summary: "Hide presence, make read receipts private (an empty body reads them)",
            request: s.of::<PrivacySetReq>(),
            body_required: false,
            reply: s.of::<PrivacyOk>(),
        },
        Rpc {
            op: op::CLIENT_STATS,
            summary: "Report the gaps only this device sees (K5 repairs) for the metrics (O1)",
            request: s.of::<ClientStatsReq>(),
            body_required: false,
            reply: s.of::<ClientStatsOk>(),
        },
        rpc(
            op::CONV_MEMBERS,
            "A conversation's current members with their join, paged by user id (G1)",
            s.of::<ConvMembersReq>(),
            s.of::<ConvMembersOk>(),
        ),
        rpc(
            op::CONV_RECEIPTS,
            "Read positions of a conversation's members (R2)",
            s.of::<ConvReceiptsReq>(),
            s.of::<ConvReceiptsOk>(),
        ),
        rpc(
            op::DELIVERY_RECEIPTS,
            "Deliveries of the caller's messages in a direct conversation (R1)",
            s.of::<DeliveryReceiptsReq>(),
            s.of::<DeliveryReceiptsOk>(),
        ),
        rpc(
            op::PUSH_REGISTER,
            "Set or replace the caller device's offline push target (P4)",
            s.of::<PushRegisterReq>(),
            s.of::<PushRegisterOk>(),
        ),
        no_fields(
            op::PUSH_LIST,
            "Push targets of the caller's devices, tokens as hash and last 4 (P4)",
            s.of::<PushListOk>(),
        ),
        Rpc {
            op: op::PUSH_REMOVE,
            summary: "Remove a device's push target (the caller's by default, P4)",
            request: s.of::<PushRemoveReq>(),
            body_required: false,
            reply: s.of::<PushRemoveOk>(),
        },
    ]
}

/// The `<op>.ok` reply over HTTP: the reply's fields and `"t": "<op>.ok"`.
fn ok_frame(op: &str, reply: RefOr<Schema>) -> RefOr<Schema> {
    let t = ObjectBuilder::new().schema_type(Type::String).enum_values(Some([format!("{op}.ok")]));
    let tagged = ObjectBuilder::new().schema_type(Type::Object).property("t", t).required("t");
    AllOfBuilder::new().item(reply).item(tagged).into()
}

fn json_content(schema: RefOr<Schema>) -> Content {
    Content::new(Some(schema))
}

/// The error statuses of every route: each status some code maps to, and
/// 413 for a body over [`FRAME_BYTES_MAX`].
fn error_responses(mut responses: ResponsesBuilder, error: &RefOr<Schema>) -> ResponsesBuilder {
    for status in ErrorCode::http_statuses() {
        let codes: Vec<&str> = ErrorCode::for_status(status).iter().map(|c| c.as_str()).collect();
        let response =
            ResponseBuilder::new().description(codes.join(", ")).content(JSON, json_content(error.clone())).build();
        responses = responses.response(status.to_string(), response);
    }
    let too_large = ResponseBuilder::new()
        .description(format!("BAD_REQUEST: the body exceeds {FRAME_BYTES_MAX} bytes"))
        .content(JSON, json_content(error.clone()))
        .build();
    responses.response("413", too_large)
}

fn post(
    summary: &str,
    security: Option<&str>,
    request: Option<(RefOr<Schema>, bool)>,
    reply: RefOr<Schema>,
    error: &RefOr<Schema>,
) -> PathItem {
    let ok = ResponseBuilder::new().description("success").content(JSON, json_content(reply)).build();
    let responses = error_responses(ResponsesBuilder::new().response("200", ok), error);
    let mut operation = OperationBuilder::new().summary(Some(summary)).responses(responses.build());
    operation = match security {
        Some(scheme) => operation.security(SecurityRequirement::new(scheme, Vec::<String>::new())),
        None => operation.securities(Some([SecurityRequirement::default()])),
    };
    if let Some((schema, required)) = request {
        let required = if required { Required::True } else { Required::False };
        let body = RequestBodyBuilder::new().required(Some(required)).content(JSON, json_content(schema)).build();
        operation = operation.request_body(Some(body));
    }
    PathItem::new(HttpMethod::Post, operation)
}

fn get(summary: &str, responses: ResponsesBuilder, security: Vec<SecurityRequirement>) -> PathItem {
    let operation = OperationBuilder::new().summary(Some(summary)).securities(Some(security)).responses(responses);
    PathItem::new(HttpMethod::Get, operation)
}

fn ws_path(error: &RefOr<Schema>) -> PathItem {
    let refusal = |description: &str| {
        ResponseBuilder::new().description(description).content(JSON, json_content(error.clone())).build()
    };
    let responses = ResponsesBuilder::new()
        .response(
            "101",
            ResponseBuilder::new().description(
                "switching protocols; frames as in docs/protocol.md (`ServerFrame`, `AuthReq`, `AuthOk` in \
                 components)",
            ),
        )
        .response(
            "400",
            refusal(
                "BAD_REQUEST: not a WebSocket upgrade request (Connection, Upgrade, Sec-WebSocket-*), or a \
             presence_batch that is not true or false",
            ),
        )
        .response("401", refusal("UNAUTHENTICATED: the Authorization header carries a refused token"))
        .response("403", refusal("DEVICE_REVOKED"))
        .response("426", refusal("BAD_REQUEST: the connection cannot be upgraded"))
        .response(
            "429",
            refusal("RATE_LIMITED: too many upgrades from this address, or the user holds its most connections"),
        )
        .response("503", refusal("UNAVAILABLE: this node holds its most WebSocket connections"));
    // Without an Authorization header the first frame must be `auth`.
    let security = vec![SecurityRequirement::new(BEARER, Vec::<String>::new()), SecurityRequirement::default()];
    let header = |name: &str, schema: ObjectBuilder| {
        ParameterBuilder::new()
            .name(name)
            .parameter_in(ParameterIn::Header)
            .required(Required::True)
            .schema(Some(schema))
            .build()
    };
    let exactly = |value: &str| ObjectBuilder::new().schema_type(Type::String).enum_values(Some([value]));
    // RFC 6455 §4.1 makes it a base64-encoded 16-byte nonce; the server
    // only needs it present (it is hashed into Sec-WebSocket-Accept).
    let key = ObjectBuilder::new().schema_type(Type::String).description(Some("the client's nonce (RFC 6455 §4.1)"));
    let operation = OperationBuilder::new()
        .summary(Some("WebSocket upgrade (docs/protocol.md §1.1)"))
        .securities(Some(security))
        .parameter(header("Connection", exactly("Upgrade")))
        .parameter(header("Upgrade", exactly("websocket")))
        .parameter(header("Sec-WebSocket-Version", exactly("13")))
        .parameter(header("Sec-WebSocket-Key", key))
        .parameter(
            ParameterBuilder::new()
                .name("presence_batch")
                .parameter_in(ParameterIn::Query)
                .required(Required::False)
                .description(Some(
                    "true: this connection takes presence.batch frames (docs/protocol.md §4.5); the same as \
                     presence_batch in the auth frame",
                ))
                .schema(Some(ObjectBuilder::new().schema_type(Type::Boolean)))
                .build(),
        )
        .responses(responses);
    PathItem::new(HttpMethod::Get, operation)
}

fn document_value() -> OpenApi {
    let mut s = Schemas::default();
    let error = s.of::<ErrorFrame>();
    let mut paths = PathsBuilder::new();
    for rpc in rpcs(&mut s) {
        let item = post(
            rpc.summary,
            Some(BEARER),
            Some((rpc.request, rpc.body_required)),
            ok_frame(rpc.op, rpc.reply),
            &error,
        );
        paths = paths.path(format!("/v1/rpc/{}", rpc.op), item);
    }
    let login = s.of::<LoginOk>();
    let accounts = [
        ("/v1/login", "Log a device in", None, Some((s.of::<LoginReq>(), true)), login.clone()),
        ("/v1/refresh", "Rotate a refresh token", None, Some((s.of::<RefreshReq>(), true)), login),
        (
            "/v1/admin/users",
            "Create a user (admin token)",
            Some(ADMIN),
            Some((s.of::<AdminUserReq>(), true)),
            s.of::<AdminUserOk>(),
        ),
        (
            "/v1/admin/conv/epoch",
            "Bump a conversation's epoch (admin token, C2)",
            Some(ADMIN),
            Some((s.of::<AdminEpochReq>(), true)),
            s.of::<AdminEpochOk>(),
        ),
        (
            "/v1/admin/logout",
            "End the sessions of a user or of one device (admin token)",
            Some(ADMIN),
            Some((s.of::<AdminLogoutReq>(), true)),
            s.of::<AdminLogoutOk>(),
        ),
        (
            "/v1/admin/deactivate",
            "Deactivate a user: every session ends, nothing accepted after (admin token)",
            Some(ADMIN),
            Some((s.of::<AdminDeactivateReq>(), true)),
            s.of::<AdminDeactivateOk>(),
        ),
        (
            "/v1/admin/delete",
            "Delete a user: devices, log and cursors removed, messages kept (admin token)",
            Some(ADMIN),
            Some((s.of::<AdminDeleteReq>(), true)),
            s.of::<AdminDeleteOk>(),
        ),
        (
            "/v1/admin/audit",
            "Audit entries by user and time range, oldest first (admin token, P1)",
            Some(ADMIN),
            Some((s.of::<AdminAuditReq>(), false)),
            s.of::<AdminAuditOk>(),
        ),
        (
            "/v1/admin/unread/rebuild",
            "Rebuild unread counts from the facts (admin token, R3)",
            Some(ADMIN),
            None,
            s.of::<AdminUnreadOk>(),
        ),
        (
            "/v1/admin/reconcile",
            "Reconcile the stored facts relation by relation; repair what is safe, report the rest (admin token, O3)",
            Some(ADMIN),
            Some((s.of::<AdminReconcileReq>(), false)),
            s.of::<AdminReconcileOk>(),
        ),
    ];
    for (path, summary, security, request, reply) in accounts {
        paths = paths.path(path, post(summary, security, request, reply, &error));
    }
    let health = ResponsesBuilder::new()
        .response("200", ResponseBuilder::new().description("ok").content(JSON, json_content(s.of::<HealthOk>())))
        .response(
            "503",
            ResponseBuilder::new()
                .description("the store does not answer")
                .content(JSON, json_content(s.of::<HealthUnavailable>())),
        );
    let open = || vec![SecurityRequirement::default()];
    paths = paths.path("/healthz", get("Liveness and outbox backlog", health, open()));
    let text = ObjectBuilder::new().schema_type(Type::String);
    let metrics = ResponsesBuilder::new().response(
        "200",
        ResponseBuilder::new()
            .description("Prometheus text format")
            .content("text/plain", Content::new(Some(RefOr::T(Schema::Object(text.build()))))),
    );
    paths = paths.path("/metrics", get("Prometheus metrics", metrics, open()));
    let doc = ResponsesBuilder::new().response(
        "200",
        ResponseBuilder::new()
            .description("this document")
            .content(JSON, json_content(tidemark_proto::openapi::object())),
    );
    paths = paths.path("/v1/openapi.json", get("This OpenAPI document", doc, open()));
    paths = paths.path("/v1/ws", ws_path(&error));
    // WebSocket frames, documented beside the HTTP shapes.
    s.of::<ServerFrame>();
    s.of::<AuthReq>();
    s.of::<AuthOk>();

    let scheme = |description: &str| {
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some(description)).build())
    };
    let components = ComponentsBuilder::new()
        .security_scheme(BEARER, scheme("device access token from /v1/login"))
        .security_scheme(ADMIN, scheme("TIDEMARK_ADMIN_TOKEN"))
        .schemas_from_iter(s.0)
        .build();
    OpenApiBuilder::new()
        .info(InfoBuilder::new().title("Tidemark").version(env!("CARGO_PKG_VERSION")).build())
        .paths(paths.build())
        .components(Some(components))
        .build()
}

/// The document, built once.
pub fn document_json() -> &'static OpenApi {
    static DOC: OnceLock<OpenApi> = OnceLock::new();
    DOC.get_or_init(document_value)
}

pub async fn document() -> Json<&'static OpenApi> {
    Json(document_json())
}
