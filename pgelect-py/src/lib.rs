//! `pgelect._native`: the extension module behind the Python package
//! `pgelect` (python/pgelect/). A thin binding of the Rust library, never a
//! second implementation: every election, lock and schema operation is the
//! library's own; this crate only moves values and errors across.
//!
//! * `runtime.rs`: the tokio runtime the extension owns (one per process,
//!   a new one in a forked child) and [`runtime::Owned`], which refuses
//!   use from a forked child.
//! * `call.rs`: [`call::Call`], one library future running on the runtime,
//!   waited for from Python (blocking with the GIL released, or from
//!   asyncio), cancellable; [`call::Signal`], a loss signal.
//! * `errors.rs`: the library's `Error` to the exceptions of
//!   `pgelect.errors`, by kind, with the library's message.
//! * `election.rs`: `Elector` and `Leadership`.
//! * `locks.rs`: lock keys, `LockSession`, its guards, semaphores and permits.
//! * `admin.rs`: `migrate`, `current_leader`, `request_resign`.
//!
//! The library's API is used here only, so that a change of its paths or
//! signatures touches these files and not the Python layer.

mod admin;
mod call;
mod election;
mod errors;
mod locks;
mod runtime;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<call::Call>()?;
    m.add_class::<call::Signal>()?;
    m.add_class::<election::Elector>()?;
    m.add_class::<election::Leadership>()?;
    m.add_class::<locks::LockSession>()?;
    m.add_class::<locks::Lock>()?;
    m.add_class::<locks::Semaphore>()?;
    m.add_class::<locks::Permit>()?;
    m.add_function(wrap_pyfunction!(locks::lock_key, m)?)?;
    m.add_function(wrap_pyfunction!(locks::lock_timeout_error, m)?)?;
    m.add_function(wrap_pyfunction!(election::fence_error, m)?)?;
    m.add_function(wrap_pyfunction!(admin::migrate, m)?)?;
    m.add_function(wrap_pyfunction!(admin::current_leader, m)?)?;
    m.add_function(wrap_pyfunction!(admin::request_resign, m)?)?;
    m.add("SCHEMA_VERSION", pgelect::schema::SCHEMA_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
