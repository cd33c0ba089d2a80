//! What the drivers report about the keeper's decisions: the logs and
//! metrics that the pure rules (`keeper.rs`) leave out.

use std::time::Duration;

use tokio::time::Instant;

use super::leadership::LossReason;

/// Reports a local deadline noticed well after it passed: the process was
/// paused or starved of CPU, and may have believed it led after its lease
/// could be taken over; only fenced writes were safe meanwhile.
pub(crate) fn loss_noticed(role: &str, reason: LossReason, now: Instant, deadline: Instant) {
    let late = now.saturating_duration_since(deadline);
    if reason == LossReason::Deadline && late > Duration::from_millis(100) {
        tracing::warn!(role, late = ?late, "the local deadline was noticed late: this process was paused or starved of CPU; only fenced writes were safe in that time");
        crate::metrics::deadline_late(role, late);
    }
}
