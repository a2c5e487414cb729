//! Errors as JSON responses that name what was wrong.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to the client: a status and `{"error": {"code", "message", "field"?}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub field: Option<String>,
    /// Seconds for a `Retry-After` header, if any.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A request field with a bad value: 422.
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            code: "invalid_field",
            message: format!("{field} {}", message.into()),
            field: Some(field.to_owned()),
            retry_after: None,
        }
    }

    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }

    /// The backing store failed: 503, without details that could leak configuration.
    pub fn unavailable(what: &str, err: impl std::fmt::Display) -> Self {
        tracing::warn!(error = %err, "{what} failed");
        metrics::counter!("sms_errors_total", "what" => what.to_owned()).increment(1);
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("{what} is unavailable; try again later"),
        )
    }

    /// With a `Retry-After` of `secs`.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }
}

impl ApiError {
    /// The JSON body: `{"error": {"code", "message", "field"?}}`.
    pub fn body(&self) -> serde_json::Value {
        let mut error = json!({"code": self.code, "message": self.message});
        if let Some(field) = &self.field {
            error["field"] = json!(field);
        }
        json!({ "error": error })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}
