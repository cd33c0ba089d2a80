//! [`Wait`]: how long a lock or permit request may wait.

use std::time::Duration;

use crate::error::{Error, Result};

/// How long a request for a lock or a permit may wait when another holder
/// has it: the third argument of every acquisition
/// ([`xact_lock`](crate::lock::xact_lock),
/// [`LockSession::acquire`](crate::LockSession::acquire),
/// [`LockSession::acquire_permit`](crate::LockSession::acquire_permit),
/// and `lock::sqlx::xact_lock` with the `sqlx` feature).
///
/// The answer has the same shape everywhere: granted (`Some(guard)`, or
/// `true` for a transaction lock); not granted at once under
/// [`Never`](Wait::Never) (`None` or `false`, and nothing changed: a
/// transaction stays usable); or an error, [`Error::LockTimeout`]
/// (`is_timeout()`) when an [`AtMost`](Wait::AtMost) wait ran out.
///
/// ```
/// use std::time::Duration;
/// use pgelect::lock::Wait;
///
/// let policies = [Wait::Never, Wait::Forever, Wait::AtMost(Duration::from_secs(5))];
/// assert_eq!(policies[2], Wait::AtMost(Duration::from_millis(5000)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Wait {
    /// Do not wait: one try (`pg_try_advisory_lock` and friends). Not
    /// granted is an ordinary answer (`None` / `false`), not an error.
    Never,
    /// Wait as long as it takes. It ends only granted or with an error: a
    /// lost connection, a cancel, or a server-side timeout of the caller's
    /// own transaction (see each function).
    Forever,
    /// Wait at most this long, then fail with [`Error::LockTimeout`]. The
    /// bound is enforced by the server (`lock_timeout`), to the
    /// millisecond: sub-millisecond durations round up to 1 ms. A zero
    /// duration is refused with [`Error::Config`] (use
    /// [`Never`](Wait::Never) for an immediate answer), and so is one
    /// longer than PostgreSQL's `lock_timeout` allows (`i32::MAX`
    /// milliseconds, about 24.8 days; use [`Forever`](Wait::Forever)).
    AtMost(Duration),
}

impl Wait {
    /// Refuses a bound the server cannot enforce (see [`Wait::AtMost`]),
    /// before any statement runs.
    pub(crate) fn check(self) -> Result<()> {
        match self {
            Wait::AtMost(bound) => wait_millis(bound).map(drop),
            Wait::Never | Wait::Forever => Ok(()),
        }
    }
}

/// The bound of a [`Wait::AtMost`] in whole milliseconds for
/// `lock_timeout` (see [`timeout_millis`]), with errors that say which
/// other policy to use.
pub(crate) fn wait_millis(bound: Duration) -> Result<i64> {
    if bound.is_zero() {
        return Err(Error::config(
            "a lock wait bound (Wait::AtMost) must be positive; use Wait::Never for an immediate answer",
        ));
    }
    timeout_millis("a lock wait bound (Wait::AtMost)", bound).map_err(|e| match e {
        Error::Config(m) => Error::config(format!("{m}; use Wait::Forever instead")),
        other => other,
    })
}

/// Converts a bound to whole milliseconds for `lock_timeout`.
///
/// Rounds up, so that a sub-millisecond bound never becomes `0` (which
/// PostgreSQL reads as "no limit"), and refuses zero and values beyond
/// PostgreSQL's `lock_timeout` range.
pub(crate) fn timeout_millis(what: &str, bound: Duration) -> Result<i64> {
    if bound.is_zero() {
        return Err(Error::config(format!("{what} must be positive")));
    }
    let ms = bound.as_nanos().div_ceil(1_000_000);
    if ms > i32::MAX as u128 {
        return Err(Error::config(format!(
            "{what} of {bound:?} is longer than PostgreSQL's lock_timeout allows ({}ms)",
            i32::MAX
        )));
    }
    Ok(ms as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_millis_rounds_up_and_refuses_zero() {
        assert!(timeout_millis("t", Duration::ZERO).is_err());
        assert_eq!(timeout_millis("t", Duration::from_nanos(1)).unwrap(), 1);
        assert_eq!(timeout_millis("t", Duration::from_micros(1500)).unwrap(), 2);
        assert_eq!(timeout_millis("t", Duration::from_secs(5)).unwrap(), 5000);
        let max = Duration::from_millis(i32::MAX as u64);
        assert_eq!(timeout_millis("t", max).unwrap(), i32::MAX as i64);
        let err = timeout_millis("t", max + Duration::from_millis(1)).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        let err = wait_millis(max + Duration::from_millis(1)).unwrap_err();
        assert!(err.to_string().contains("Wait::Forever"), "{err}");
    }

    #[test]
    fn only_a_bound_is_checked() {
        assert!(Wait::Never.check().is_ok());
        assert!(Wait::Forever.check().is_ok());
        assert!(Wait::AtMost(Duration::from_millis(1)).check().is_ok());
        let err = Wait::AtMost(Duration::ZERO).check().unwrap_err();
        assert!(err.to_string().contains("Wait::Never"), "{err}");
    }
}
