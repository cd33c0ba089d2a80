//! Metric names, recorded through the [`metrics`] facade.
//!
//! pgelect records nothing unless the application installs a recorder (for
//! example `metrics-exporter-prometheus`). Every metric carries the label
//! `role`; losses also carry `reason`.
//!
//! ```
//! // The names, for dashboards and alerts (deploy/ uses exactly these).
//! assert_eq!(pgelect::metrics::IS_LEADER, "pgelect_is_leader");
//! assert_eq!(pgelect::metrics::TERM, "pgelect_term");
//! ```
//!
//! The book's [dashboards chapter](../../../book/operations/dashboards.html)
//! shows them on a Grafana dashboard and in Prometheus alerts.

/// Gauge: 1 while this process leads the role (after the handover delay),
/// 0 otherwise.
pub const IS_LEADER: &str = "pgelect_is_leader";
/// Gauge: the fencing term of the current or last leadership of this process.
pub const TERM: &str = "pgelect_term";
/// Counter: leaderships won (counted when the user is told).
pub const ELECTIONS: &str = "pgelect_elections_total";
/// Counter: leaderships ended, labelled by `reason` (`shutdown`,
/// `connection_lost`, `deadline`, `preempted`, `resigned`, `dropped`).
pub const LOSSES: &str = "pgelect_leadership_losses_total";
/// Histogram, seconds: round trip of a successful renewal.
pub const RENEW_SECONDS: &str = "pgelect_renew_duration_seconds";
/// Gauge, seconds: time left before the local deadline right after a
/// successful renewal; compare with `ttl - safety_margin` (the budget).
pub const DEADLINE_REMAINING_SECONDS: &str = "pgelect_deadline_remaining_seconds";
/// Histogram, seconds: from the lock being granted to the user being told
/// (the term transaction plus, after an unclean loss, the handover delay).
pub const TAKEOVER_SECONDS: &str = "pgelect_takeover_duration_seconds";
/// Counter: statements sent by the lease backend (acquire, renew, release),
/// labelled by `kind`.
pub const LEASE_STATEMENTS: &str = "pgelect_lease_statements_total";
/// Counter: zombie leaders whose backend this process terminated.
pub const PREEMPTIONS: &str = "pgelect_preemptions_total";
/// Histogram, seconds: how late a local deadline was noticed, recorded when
/// over 100 ms (the process was paused or starved of CPU).
pub const DEADLINE_LATE_SECONDS: &str = "pgelect_deadline_late_seconds";
/// Gauge: backends holding this role's lock that are not the leader its
/// lease row names (squatters), as this process's waiting standby last saw
/// them; 0 when none or when not waiting.
pub const SQUATTERS: &str = "pgelect_lock_squatters";

pub(crate) fn leader_on(role: &str, term: i64, takeover: std::time::Duration) {
    let role = role.to_owned();
    metrics::gauge!(IS_LEADER, "role" => role.clone()).set(1.0);
    metrics::gauge!(TERM, "role" => role.clone()).set(term as f64);
    metrics::counter!(ELECTIONS, "role" => role.clone()).increment(1);
    metrics::histogram!(TAKEOVER_SECONDS, "role" => role).record(takeover.as_secs_f64());
}

/// A candidate starts standing: `is_leader` 0 unless it already leads the
/// role through another elector of this process (then left as it is).
pub(crate) fn standing(role: &str) {
    let gauge = metrics::gauge!(IS_LEADER, "role" => role.to_owned());
    // Incrementing by zero registers the series without overwriting a 1.
    gauge.increment(0.0);
}

pub(crate) fn leader_off(role: &str, reason: &'static str) {
    let role = role.to_owned();
    metrics::gauge!(IS_LEADER, "role" => role.clone()).set(0.0);
    metrics::counter!(LOSSES, "role" => role, "reason" => reason).increment(1);
}

pub(crate) fn renewed(role: &str, round_trip: std::time::Duration, remaining: std::time::Duration) {
    let role = role.to_owned();
    metrics::histogram!(RENEW_SECONDS, "role" => role.clone()).record(round_trip.as_secs_f64());
    metrics::gauge!(DEADLINE_REMAINING_SECONDS, "role" => role).set(remaining.as_secs_f64());
}

pub(crate) fn deadline_late(role: &str, late: std::time::Duration) {
    metrics::histogram!(DEADLINE_LATE_SECONDS, "role" => role.to_owned())
        .record(late.as_secs_f64());
}

pub(crate) fn preempted_zombie(role: &str) {
    metrics::counter!(PREEMPTIONS, "role" => role.to_owned()).increment(1);
}

pub(crate) fn lease_statement(role: &str, kind: &'static str) {
    metrics::counter!(LEASE_STATEMENTS, "role" => role.to_owned(), "kind" => kind).increment(1);
}

pub(crate) fn squatters(role: &str, n: usize) {
    metrics::gauge!(SQUATTERS, "role" => role.to_owned()).set(n as f64);
}
