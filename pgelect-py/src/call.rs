//! One library future, run on the extension's runtime and waited for from
//! Python; and loss signals.

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::errors;
use crate::runtime::{runtime, seconds};

/// What a finished future hands to Python.
pub(crate) trait Outcome: Send + 'static {
    /// The Python value.
    fn into_py(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>>;
    /// Called instead of `into_py` when the caller gave up after the future
    /// completed (a cancelled wait): let go of what it won.
    fn discard(self: Box<Self>) {}
}

/// A plain value converted by a closure.
pub(crate) struct Value<F>(pub(crate) F);

impl<F> Outcome for Value<F>
where
    F: FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send + 'static,
{
    fn into_py(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        (self.0)(py)
    }
}

enum State {
    Running,
    Done(Result<Box<dyn Outcome>, pgelect::Error>),
    Taken,
    Cancelled,
}

struct Inner {
    state: State,
    /// When the state left `Running`: what the wait costs on top of the
    /// library is measured from here (`Call.completed_ago`, pgelect-py/bench.py).
    completed: Option<Instant>,
    /// Called once, with the GIL, when the state leaves `Running`.
    callback: Option<Py<PyAny>>,
}

struct Shared {
    inner: Mutex<Inner>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leaves `Running` (once), wakes the waiters and calls the callback.
    fn finish(&self, state: State) {
        let callback = {
            let mut inner = self.lock();
            if !matches!(inner.state, State::Running) {
                return;
            }
            inner.state = state;
            inner.completed = Some(Instant::now());
            inner.callback.take()
        };
        self.changed.notify_all();
        if let Some(cb) = callback {
            Python::attach(|py| {
                if let Err(e) = cb.call0(py) {
                    e.write_unraisable(py, None);
                }
            });
        }
    }
}

/// Marks the call cancelled when its task is dropped before finishing
/// (aborted, or the runtime shutting down).
struct CancelOnDrop(Arc<Shared>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.finish(State::Cancelled);
    }
}

/// An operation of the library in flight. `wait` blocks with the GIL
/// released, `add_done_callback` serves asyncio, `cancel` stops it and
/// returns once it has stopped (no task left, nothing held).
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct Call {
    shared: Arc<Shared>,
    abort: tokio::task::AbortHandle,
    pid: u32,
}

/// Runs `future` on the runtime.
pub(crate) fn spawn<F, T>(future: F) -> PyResult<Call>
where
    F: Future<Output = pgelect::Result<T>> + Send + 'static,
    T: Outcome,
{
    let rt = runtime()?;
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner {
            state: State::Running,
            completed: None,
            callback: None,
        }),
        changed: Condvar::new(),
    });
    let task_shared = shared.clone();
    let handle = rt.spawn(async move {
        let on_drop = CancelOnDrop(task_shared.clone());
        let result = future.await;
        task_shared.finish(State::Done(result.map(|t| Box::new(t) as Box<dyn Outcome>)));
        drop(on_drop);
    });
    Ok(Call {
        shared,
        abort: handle.abort_handle(),
        pid: std::process::id(),
    })
}

impl Call {
    fn check(&self) -> PyResult<()> {
        if std::process::id() == self.pid {
            Ok(())
        } else {
            Err(errors::plain(
                "ForkError",
                "this operation was started before a fork, in the parent process; start it again in the child",
            ))
        }
    }
}

#[pymethods]
impl Call {
    /// Waits at most `timeout` seconds (for ever with `None`) with the GIL
    /// released; true once the operation has finished.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        self.check()?;
        let bound = timeout.map(|t| seconds("timeout", t)).transpose()?;
        let shared = self.shared.clone();
        Ok(py.detach(move || {
            let start = Instant::now();
            let mut inner = shared.lock();
            loop {
                if !matches!(inner.state, State::Running) {
                    return true;
                }
                let left = match bound {
                    None => Duration::from_secs(3600),
                    Some(b) => match b.checked_sub(start.elapsed()) {
                        Some(left) if !left.is_zero() => left,
                        _ => return false,
                    },
                };
                inner = shared
                    .changed
                    .wait_timeout(inner, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }))
    }

    /// Seconds since the operation finished (the library's future
    /// returned, or it was cancelled); `None` while it runs. What waiting
    /// and returning to Python cost on top of the library is this, read
    /// right after the wait returns (pgelect-py/bench.py).
    fn completed_ago(&self) -> Option<f64> {
        self.shared
            .lock()
            .completed
            .map(|at| at.elapsed().as_secs_f64())
    }

    /// True once the operation has finished (or was cancelled).
    fn done(&self) -> bool {
        !matches!(self.shared.lock().state, State::Running)
    }

    /// The result: the value, or the library's error as an exception of
    /// `pgelect.errors`. Once only.
    fn result(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.check()?;
        let state = {
            let mut inner = self.shared.lock();
            match inner.state {
                State::Running => {
                    return Err(errors::plain(
                        "PgelectError",
                        "the operation has not finished",
                    ))
                }
                State::Cancelled => {
                    return Err(errors::plain(
                        "CancelledError",
                        "the operation was cancelled",
                    ))
                }
                State::Taken => {
                    return Err(errors::plain(
                        "PgelectError",
                        "the result was taken already",
                    ))
                }
                State::Done(_) => std::mem::replace(&mut inner.state, State::Taken),
            }
        };
        match state {
            State::Done(Ok(v)) => v.into_py(py),
            State::Done(Err(e)) => Err(errors::to_py(e)),
            _ => unreachable!("checked above"),
        }
    }

    /// Stops the operation and returns once it has stopped, with the GIL
    /// released. If it had completed and its result was not taken, what it
    /// won is let go (a leadership resigned, a lock released).
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        self.check()?;
        self.abort.abort();
        let shared = self.shared.clone();
        py.detach(move || {
            let mut inner = shared.lock();
            while matches!(inner.state, State::Running) {
                inner = shared
                    .changed
                    .wait(inner)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if matches!(inner.state, State::Done(_)) {
                if let State::Done(Ok(v)) = std::mem::replace(&mut inner.state, State::Cancelled) {
                    drop(inner);
                    if let Ok(rt) = runtime() {
                        let _entered = rt.enter();
                        v.discard();
                    }
                }
            }
        });
        Ok(())
    }

    /// Calls `callback()` (no arguments) once the operation finished: at
    /// once if it has, else from a runtime thread with the GIL. For
    /// asyncio, pass a function that hands over to the loop
    /// (`loop.call_soon_threadsafe`).
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        self.check()?;
        {
            let mut inner = self.shared.lock();
            if matches!(inner.state, State::Running) {
                inner.callback = Some(callback);
                return Ok(());
            }
        }
        callback.call0(py)?;
        Ok(())
    }
}

/// A loss signal: set when a leadership or a lock is lost (or, for the
/// duties of `Elector.run`, when the elector shuts down).
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct Signal {
    token: CancellationToken,
    reason: Box<dyn Fn() -> Option<String> + Send + Sync>,
    pid: u32,
}

impl Signal {
    pub(crate) fn new(
        token: CancellationToken,
        reason: impl Fn() -> Option<String> + Send + Sync + 'static,
    ) -> Signal {
        Signal {
            token,
            reason: Box::new(reason),
            pid: std::process::id(),
        }
    }

    fn check(&self) -> PyResult<()> {
        if std::process::id() == self.pid {
            Ok(())
        } else {
            Err(errors::plain(
                "ForkError",
                "this signal belongs to a leadership or lock of the parent process, before a fork",
            ))
        }
    }
}

#[pymethods]
impl Signal {
    /// True once set.
    fn is_set(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Waits at most `timeout` seconds with the GIL released; true once set.
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        self.check()?;
        let bound = seconds("timeout", timeout)?;
        let rt = runtime()?;
        let token = self.token.clone();
        Ok(py.detach(move || {
            rt.block_on(async { tokio::time::timeout(bound, token.cancelled()).await.is_ok() })
        }))
    }

    /// A call that completes when the signal is set (for asyncio).
    fn call(&self) -> PyResult<Call> {
        self.check()?;
        let token = self.token.clone();
        spawn(async move {
            token.cancelled().await;
            Ok(Value(|py: Python<'_>| Ok(py.None())))
        })
    }

    /// Why it was set, where known (a leadership's loss reason).
    fn reason(&self) -> Option<String> {
        (self.reason)()
    }
}
