//! Leader election: the `Elector`, its backends and the `Leadership` handle.
