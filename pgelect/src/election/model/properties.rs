//! The properties checked on every state reached ((a) to (d), see the
//! module's documentation) and the examples that must be found, so that a
//! pass is not vacuous.

use stateright::Property;

use super::state::{ElectionModel, State};

/// Every property, the `always` ones first.
pub(super) fn all() -> Vec<Property<ElectionModel>> {
    let mut properties = vec![
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
    ];
    // The examples that are one flag of the state each (a closure that
    // names a field captures nothing, so it is the plain `fn` stateright
    // takes).
    macro_rules! seen {
        ($($name:literal => $flag:ident),* $(,)?) => {
            [$(Property::sometimes($name, |_: &ElectionModel, st: &State| st.$flag)),*]
        };
    }
    properties.extend(seen![
        "an unclean takeover" => seen_unclean_takeover,
        "a fenced write commits" => seen_write,
        "the fence refuses a stale write" => seen_fence_refusal,
        "a holder idle before its term is preempted" => seen_idle_preempt,
        "the watch key passes from one standby to another" => seen_watch_handoff,
        "a queued standby ends an idle watch" => seen_watch_end,
    ]);
    properties
}
