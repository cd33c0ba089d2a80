//! The admin side: installing the schema, reading the current leader,
//! asking it to resign.

use std::time::UNIX_EPOCH;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::call::{spawn, Call, Value};
use crate::runtime::seconds;

/// Connection options from a URL (or `key=value` string), with pgelect's
/// schema and a connect timeout when given.
pub(crate) fn options(
    url: &str,
    schema: Option<&str>,
    connect_timeout: Option<f64>,
) -> PyResult<pgelect::ConnectOptions> {
    let mut options = pgelect::ConnectOptions::from_url(url).map_err(crate::errors::to_py)?;
    if let Some(s) = schema {
        options = options.schema(s).map_err(crate::errors::to_py)?;
    }
    if let Some(t) = connect_timeout {
        options = options
            .connect_timeout(seconds("connect_timeout", t)?)
            .map_err(crate::errors::to_py)?;
    }
    Ok(options)
}

/// Installs or upgrades the schema; the call's value is the number of
/// migrations applied.
#[pyfunction]
#[pyo3(signature = (url, *, schema=None, connect_timeout=None))]
pub(crate) fn migrate(
    url: &str,
    schema: Option<&str>,
    connect_timeout: Option<f64>,
) -> PyResult<Call> {
    let options = options(url, schema, connect_timeout)?;
    spawn(async move {
        let n = pgelect::migrate(&options).await?;
        Ok(Value(move |py: Python<'_>| {
            Ok(n.into_pyobject(py)?.into_any().unbind())
        }))
    })
}

/// The role's current leader as a dict, or `None`.
#[pyfunction]
#[pyo3(signature = (url, role, *, schema=None, connect_timeout=None))]
pub(crate) fn current_leader(
    url: &str,
    role: &str,
    schema: Option<&str>,
    connect_timeout: Option<f64>,
) -> PyResult<Call> {
    let options = options(url, schema, connect_timeout)?;
    let role = role.to_owned();
    spawn(async move {
        let info = pgelect::admin::current_leader(&options, &role).await?;
        Ok(Value(move |py: Python<'_>| leader_info(py, info)))
    })
}

/// Asks the role's leader to resign; the call's value is the leader asked
/// (a dict) or `None` when there was none.
#[pyfunction]
#[pyo3(signature = (url, role, *, schema=None, connect_timeout=None))]
pub(crate) fn request_resign(
    url: &str,
    role: &str,
    schema: Option<&str>,
    connect_timeout: Option<f64>,
) -> PyResult<Call> {
    let options = options(url, schema, connect_timeout)?;
    let role = role.to_owned();
    spawn(async move {
        let info = pgelect::admin::request_resign(&options, &role).await?;
        Ok(Value(move |py: Python<'_>| leader_info(py, info)))
    })
}

fn leader_info(py: Python<'_>, info: Option<pgelect::election::LeaderInfo>) -> PyResult<Py<PyAny>> {
    let Some(info) = info else {
        return Ok(py.None());
    };
    let secs = |t: std::time::SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    };
    let d = PyDict::new(py);
    d.set_item("role", &info.role)?;
    d.set_item("holder", &info.holder)?;
    d.set_item("term", info.term.get())?;
    d.set_item("acquired_at", secs(info.acquired_at))?;
    d.set_item("renewed_at", secs(info.renewed_at))?;
    d.set_item("lease_until", secs(info.lease_until))?;
    d.set_item("lease_expired", info.lease_expired)?;
    d.set_item("backend", info.backend.as_deref())?;
    d.set_item("holder_pid", info.holder_pid)?;
    d.set_item(
        "holder_meta",
        info.holder_meta.as_ref().map(|m| m.to_string()),
    )?;
    Ok(d.into_any().unbind())
}
