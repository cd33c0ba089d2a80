//! Lock keys, session locks and semaphores.

use pgelect::lock::{LockMode, Wait};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyInt, PyString, PyTuple};

use crate::admin::options;
use crate::call::{spawn, Call, Outcome, Signal, Value};
use crate::errors;
use crate::runtime::{seconds, Owned};

/// A key from Python: a name (`str`, hashed as SQL `pgelect.key(name)`),
/// an `int` (the bigint key space) or a pair of `int`s (the two-integer
/// key space).
pub(crate) fn key_of(key: &Bound<'_, PyAny>) -> PyResult<pgelect::LockKey> {
    let bad = |m: String| errors::to_py(crate::election::config_error(m));
    if let Ok(name) = key.cast::<PyString>() {
        return pgelect::LockKey::from_name(&name.to_cow()?).map_err(errors::to_py);
    }
    if key.is_instance_of::<PyInt>() {
        let k: i64 = key
            .extract()
            .map_err(|_| bad(format!("lock key {key} is out of the bigint range")))?;
        return Ok(pgelect::LockKey::from_i64(k));
    }
    if let Ok(t) = key.cast::<PyTuple>() {
        if t.len() == 2 {
            let (a, b): (i32, i32) = t.extract().map_err(|_| {
                bad(format!(
                    "lock key pair {key} must be two integers in the int4 range"
                ))
            })?;
            return Ok(pgelect::LockKey::from_pair(a, b));
        }
    }
    Err(bad(format!(
        "a lock key is a name (str), an int or a pair of ints, got {}",
        key.get_type().name()?
    )))
}

/// `(display, params)` of a key, for the transaction locks the Python layer
/// runs on psycopg: `params` has one int (bigint key space) or two (the
/// pair), the values the library's SQL passes.
#[pyfunction]
pub(crate) fn lock_key(key: &Bound<'_, PyAny>) -> PyResult<(String, Vec<i64>)> {
    let k = key_of(key)?;
    let params = match k {
        pgelect::LockKey::Single(v) => vec![v],
        pgelect::LockKey::Pair(a, b) => vec![i64::from(a), i64::from(b)],
    };
    Ok((k.to_string(), params))
}

/// The library's lock timeout error for a transaction lock wait that ran
/// out after `waited` seconds.
#[pyfunction]
pub(crate) fn lock_timeout_error(py: Python<'_>, key: &str, waited: f64) -> PyResult<Py<PyAny>> {
    let e = pgelect::Error::LockTimeout {
        key: key.to_owned(),
        waited: seconds("waited", waited)?,
        holders: Vec::new(),
    };
    Ok(errors::to_py_object(py, e))
}

/// A session of locks on a connection the library owns.
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct LockSession {
    inner: Owned<Arc<pgelect::LockSession>>,
}

struct Connected(pgelect::LockSession);

impl Outcome for Connected {
    fn into_py(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(Py::new(
            py,
            LockSession {
                inner: Owned::new("LockSession", Arc::new(self.0)),
            },
        )?
        .into_any())
    }
}

/// The lock mode of the binding's `shared` flag.
fn mode_of(shared: bool) -> LockMode {
    if shared {
        LockMode::Shared
    } else {
        LockMode::Exclusive
    }
}

/// A guard, or `None` from a try that found the key taken.
struct Guard(Option<pgelect::lock::LockGuard>);

impl Outcome for Guard {
    fn into_py(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self.0 {
            None => Ok(py.None()),
            Some(g) => {
                let lost = g.token();
                let key = g.key().to_string();
                Ok(Py::new(
                    py,
                    Lock {
                        inner: Owned::new("Lock", g),
                        lost,
                        key,
                    },
                )?
                .into_any())
            }
        }
    }
}

struct Granted(Option<pgelect::lock::Permit>);

impl Outcome for Granted {
    fn into_py(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self.0 {
            None => Ok(py.None()),
            Some(p) => {
                let lost = p.token();
                let (semaphore, slot) = (p.semaphore().to_owned(), p.slot());
                Ok(Py::new(
                    py,
                    Permit {
                        inner: Owned::new("Permit", p),
                        lost,
                        semaphore,
                        slot,
                    },
                )?
                .into_any())
            }
        }
    }
}

#[pymethods]
impl LockSession {
    /// Connects; the call's value is a `LockSession`.
    #[staticmethod]
    #[pyo3(signature = (url, *, name=None, schema=None, connect_timeout=None))]
    fn connect(
        url: &str,
        name: Option<String>,
        schema: Option<&str>,
        connect_timeout: Option<f64>,
    ) -> PyResult<Call> {
        let options = options(url, schema, connect_timeout)?;
        spawn(async move {
            let mut b = pgelect::LockSession::builder(&options);
            if let Some(n) = name {
                b = b.name(n);
            }
            Ok(Connected(b.connect().await?))
        })
    }

    /// Takes `key`: waits for ever (`timeout=None`) or at most `timeout`
    /// seconds. The call's value is a `Lock`.
    #[pyo3(signature = (key, *, shared=false, timeout=None))]
    fn lock(&self, key: &Bound<'_, PyAny>, shared: bool, timeout: Option<f64>) -> PyResult<Call> {
        let key = key_of(key)?;
        let session = self.inner.with(Arc::clone)?;
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        spawn(async move {
            let wait = timeout.map_or(Wait::Forever, Wait::AtMost);
            Ok(Guard(session.acquire(key, mode_of(shared), wait).await?))
        })
    }

    /// Tries `key` once; the call's value is a `Lock` or `None`.
    #[pyo3(signature = (key, *, shared=false))]
    fn try_lock(&self, key: &Bound<'_, PyAny>, shared: bool) -> PyResult<Call> {
        let key = key_of(key)?;
        let session = self.inner.with(Arc::clone)?;
        spawn(async move {
            Ok(Guard(
                session.acquire(key, mode_of(shared), Wait::Never).await?,
            ))
        })
    }

    /// Takes a permit of `semaphore`, waiting for ever or at most `timeout`
    /// seconds; the call's value is a `Permit`.
    #[pyo3(signature = (semaphore, *, timeout=None))]
    fn acquire_permit(&self, semaphore: &Semaphore, timeout: Option<f64>) -> PyResult<Call> {
        let session = self.inner.with(Arc::clone)?;
        let sem = semaphore.inner.clone();
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        spawn(async move {
            let wait = timeout.map_or(Wait::Forever, Wait::AtMost);
            Ok(Granted(session.acquire_permit(&sem, wait).await?))
        })
    }

    /// Tries for a permit once; the call's value is a `Permit` or `None`.
    fn try_acquire_permit(&self, semaphore: &Semaphore) -> PyResult<Call> {
        let session = self.inner.with(Arc::clone)?;
        let sem = semaphore.inner.clone();
        spawn(async move { Ok(Granted(session.acquire_permit(&sem, Wait::Never).await?)) })
    }

    /// Set when the session's connection is lost (every lock with it).
    fn lost_signal(&self) -> PyResult<Signal> {
        let token = self.inner.with(|s| s.token())?;
        Ok(Signal::new(token, || None))
    }

    fn is_lost(&self) -> PyResult<bool> {
        self.inner.with(|s| s.is_lost())
    }

    fn backend_pid(&self) -> PyResult<i32> {
        self.inner.with(|s| s.backend_pid())
    }

    /// Drops the session: its connection closes and every lock it holds is
    /// released by the server.
    fn close(&self) -> PyResult<()> {
        self.inner.take().map(drop)
    }
}

/// A held session lock (the library's `LockGuard`).
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct Lock {
    inner: Owned<pgelect::lock::LockGuard>,
    lost: tokio_util::sync::CancellationToken,
    key: String,
}

#[pymethods]
impl Lock {
    /// Releases it; the call's value is whether the server still held it.
    /// A no-op (value `False`) after a first call.
    fn release(&self) -> PyResult<Call> {
        let guard = self.inner.take()?;
        spawn(async move {
            let held = match guard {
                Some(g) => g.release().await?,
                None => false,
            };
            Ok(Value(move |py: Python<'_>| {
                Ok(pyo3::types::PyBool::new(py, held)
                    .to_owned()
                    .into_any()
                    .unbind())
            }))
        })
    }

    fn lost_signal(&self) -> PyResult<Signal> {
        self.inner.check()?;
        Ok(Signal::new(self.lost.clone(), || None))
    }

    fn key(&self) -> String {
        self.key.clone()
    }
}

/// A semaphore: at most `limit` holders of its permits at once.
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct Semaphore {
    inner: pgelect::lock::Semaphore,
}

#[pymethods]
impl Semaphore {
    #[new]
    fn new(name: String, limit: u32) -> PyResult<Self> {
        Ok(Semaphore {
            inner: pgelect::lock::Semaphore::new(name, limit).map_err(errors::to_py)?,
        })
    }

    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    fn limit(&self) -> u32 {
        self.inner.limit()
    }
}

/// A held permit (the library's `Permit`).
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct Permit {
    inner: Owned<pgelect::lock::Permit>,
    lost: tokio_util::sync::CancellationToken,
    semaphore: String,
    slot: u32,
}

#[pymethods]
impl Permit {
    /// Releases it; the call's value is whether the server still held it.
    fn release(&self) -> PyResult<Call> {
        let permit = self.inner.take()?;
        spawn(async move {
            let held = match permit {
                Some(p) => p.release().await?,
                None => false,
            };
            Ok(Value(move |py: Python<'_>| {
                Ok(pyo3::types::PyBool::new(py, held)
                    .to_owned()
                    .into_any()
                    .unbind())
            }))
        })
    }

    fn lost_signal(&self) -> PyResult<Signal> {
        self.inner.check()?;
        Ok(Signal::new(self.lost.clone(), || None))
    }

    fn semaphore(&self) -> String {
        self.semaphore.clone()
    }

    fn slot(&self) -> u32 {
        self.slot
    }
}
