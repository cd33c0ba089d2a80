//! The properties checked on every state reached ((a) to (d), see the
//! module's documentation) and the examples that must be found, so that a
//! pass is not vacuous.

use stateright::Property;

use super::state::{ElectionModel, State};

/// Every property, the `always` ones first.
pub(super) fn all() -> Vec<Property<ElectionModel>> {
    vec![
        Property::always("(a) one acting leader", |m: &ElectionModel, st: &State| {
            (0..m.s.roles).all(|r| st.acting(r).len() <= 1)
        }),
        Property::always(
            "(b)(c) writes and terms in order",
            |_: &ElectionModel, st: &State| st.broken.is_none(),
        ),
        Property::always(
            "(d) a leader within the bound",
            |m: &ElectionModel, st: &State| st.unled.iter().all(|&u| u <= m.s.liveness_bound()),
        ),
        Property::sometimes("a leader acts", |m: &ElectionModel, st: &State| {
            (0..m.s.roles).any(|r| !st.acting(r).is_empty())
        }),
        Property::sometimes("a second term acts", |_: &ElectionModel, st: &State| {
            st.last_active.iter().any(|&t| t >= 2)
        }),
        Property::sometimes("an unclean takeover", |_: &ElectionModel, st: &State| {
            st.seen_unclean_takeover
        }),
        Property::sometimes("a fenced write commits", |_: &ElectionModel, st: &State| {
            st.seen_write
        }),
        Property::sometimes(
            "the fence refuses a stale write",
            |_: &ElectionModel, st: &State| st.seen_fence_refusal,
        ),
        Property::sometimes(
            "a holder idle before its term is preempted",
            |_: &ElectionModel, st: &State| st.seen_idle_preempt,
        ),
        Property::sometimes(
            "the watch key passes from one standby to another",
            |_: &ElectionModel, st: &State| st.seen_watch_handoff,
        ),
        Property::sometimes(
            "a queued standby ends an idle watch",
            |_: &ElectionModel, st: &State| st.seen_watch_end,
        ),
    ]
}
