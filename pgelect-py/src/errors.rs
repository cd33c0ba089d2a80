//! The library's errors as the exceptions of `pgelect.errors` (defined in
//! Python, python/pgelect/errors.py), with the library's own messages.

use pyo3::prelude::*;

/// The exception class of `pgelect.errors` for `e`: by the library's own
/// classification (`is_*`), the specific variants first.
fn class_of(e: &pgelect::Error) -> &'static str {
    use pgelect::Error as E;
    match e {
        E::StaleTerm { .. } => return "StaleTermError",
        E::NoLeader { .. } => return "NoLeaderError",
        E::LeadershipLost { .. } => return "LeadershipLostError",
        E::AlreadyHeld { .. } => return "AlreadyHeldError",
        E::Pooler(_) => return "PoolerError",
        E::ConnectTimeout { .. } => return "ConnectTimeout",
        E::LockTimeout { .. } | E::MigrationLockTimeout { .. } => return "LockTimeout",
        _ => {}
    }
    if e.is_auth() {
        "AuthenticationError"
    } else if e.is_permission() {
        "PermissionDenied"
    } else if e.is_schema() {
        "SchemaError"
    } else if e.is_config() {
        "ConfigurationError"
    } else if e.is_connection() {
        "ConnectionError"
    } else if e.is_timeout() {
        "LockTimeout"
    } else if e.is_leadership_lost() {
        "LeadershipLostError"
    } else if matches!(e, E::Database { .. }) {
        "DatabaseError"
    } else {
        "PgelectError"
    }
}

/// An exception of class `class` with `message` and `sqlstate`.
fn make(py: Python<'_>, class: &str, message: String, sqlstate: Option<&str>) -> PyErr {
    let built = (|| -> PyResult<PyErr> {
        let module = py.import("pgelect.errors")?;
        let exc = module.getattr(class)?.call1((message.clone(),))?;
        exc.setattr("sqlstate", sqlstate)?;
        Ok(PyErr::from_value(exc))
    })();
    built.unwrap_or_else(|e| {
        pyo3::exceptions::PyRuntimeError::new_err(format!(
            "{message} (and pgelect.errors.{class} could not be raised: {e})"
        ))
    })
}

/// The library's error as an exception.
pub(crate) fn to_py(e: pgelect::Error) -> PyErr {
    Python::attach(|py| make(py, class_of(&e), e.to_string(), e.sqlstate()))
}

/// The library's error as an exception object (not raised).
pub(crate) fn to_py_object(py: Python<'_>, e: pgelect::Error) -> Py<PyAny> {
    to_py(e).into_value(py).into_any()
}

/// An exception of the binding's own (fork, cancelled, closed).
pub(crate) fn plain(class: &str, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| make(py, class, message, None))
}
