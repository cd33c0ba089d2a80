//! The runtime the extension owns, and objects owned by one process.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::errors;

/// The process's runtime: `(pid, runtime)`. Leaked on purpose: it lives as
/// long as the process (dropping it would end the leaderships and locks of
/// every object still alive), and in a forked child the parent's runtime,
/// whose threads were not copied, must never be dropped or used.
static RUNTIME: Mutex<Option<(u32, &'static Runtime)>> = Mutex::new(None);

/// The runtime of this process: started on first use, and again on first
/// use in a forked child (the parent's has no threads there).
pub(crate) fn runtime() -> PyResult<&'static Runtime> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((owner, rt)) = *slot {
        if owner == pid {
            return Ok(rt);
        }
    }
    // Two workers: the library's tasks mostly wait on the network and
    // timers; its deadline watchdog is a thread of its own.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pgelect-py")
        .enable_all()
        .build()
        .map_err(|e| errors::plain("PgelectError", format!("cannot start the runtime: {e}")))?;
    let rt: &'static Runtime = Box::leak(Box::new(rt));
    *slot = Some((pid, rt));
    Ok(rt)
}

/// A value owned by the process that made it. A forked child gets a clear
/// error instead of sharing the parent's connection, and never drops it
/// (dropping would run the parent's release logic on a copy of the
/// parent's socket from the wrong process).
pub(crate) struct Owned<T> {
    pid: u32,
    what: &'static str,
    inner: Mutex<Option<T>>,
}

impl<T> Owned<T> {
    pub(crate) fn new(what: &'static str, value: T) -> Owned<T> {
        Owned {
            pid: std::process::id(),
            what,
            inner: Mutex::new(Some(value)),
        }
    }

    /// Fails in a process forked after this value was made.
    pub(crate) fn check(&self) -> PyResult<()> {
        let now = std::process::id();
        if now == self.pid {
            return Ok(());
        }
        Err(errors::plain(
            "ForkError",
            format!(
                "this {} was created in process {} and cannot be used in process {now}, a fork of it: \
                 its connection belongs to the parent; create a new one in the child (for example in \
                 gunicorn's post_fork or Celery's worker_process_init hook)",
                self.what, self.pid
            ),
        ))
    }

    /// Runs `f` on the value; fails after a fork or once it was closed.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&T) -> R) -> PyResult<R> {
        self.check()?;
        let guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some(v) => Ok(f(v)),
            None => Err(errors::plain(
                "PgelectError",
                format!("this {} is closed", self.what),
            )),
        }
    }

    /// Takes the value out (closing); `None` if it was taken already.
    pub(crate) fn take(&self) -> PyResult<Option<T>> {
        self.check()?;
        Ok(self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take())
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        let value = self
            .inner
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if std::process::id() != self.pid {
            std::mem::forget(value);
            return;
        }
        // The library's drops may spawn their release on the runtime.
        match runtime() {
            Ok(rt) => {
                let _entered = rt.enter();
                drop(value);
            }
            Err(_) => drop(value),
        }
    }
}

/// Seconds from Python as a duration; a negative, infinite or NaN value is
/// a configuration error naming `what`.
pub(crate) fn seconds(what: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        errors::plain(
            "ConfigurationError",
            format!("invalid configuration: {what} must be a finite, non-negative number of seconds, got {secs}"),
        )
    })
}
