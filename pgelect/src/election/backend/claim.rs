//! One candidate per role on a shared client: a role's place, claimed
//! when its elector is built and given back when the elector (and any
//! leadership it handed out) is gone.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use crate::election::config_error::ConfigError;
use crate::error::{Error, Result};

/// The roles that have a candidate on one shared client.
#[derive(Debug, Default)]
pub(crate) struct Roles(Arc<Mutex<HashSet<String>>>);

impl Roles {
    /// Claims `role` for `client`'s candidate; refused, with `refusal`,
    /// while another candidate holds it.
    pub(crate) fn claim<C>(
        &self,
        client: C,
        role: &str,
        refusal: &'static str,
    ) -> Result<Claim<C>> {
        if !self.set().insert(role.to_owned()) {
            return Err(Error::Config(ConfigError::RoleAlreadyShared {
                role: role.to_owned(),
                why: refusal,
            }));
        }
        Ok(Claim {
            client,
            roles: self.0.clone(),
            role: role.to_owned(),
        })
    }

    /// How many roles are claimed.
    pub(crate) fn len(&self) -> usize {
        self.set().len()
    }

    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // Only inserted into and removed from: a panic elsewhere that
        // poisoned the lock left the set consistent.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A role's place on a shared client, given back when dropped.
pub(crate) struct Claim<C> {
    client: C,
    roles: Arc<Mutex<HashSet<String>>>,
    role: String,
}

impl<C: Clone> Claim<C> {
    /// The client the role is claimed on.
    pub(crate) fn client(&self) -> C {
        self.client.clone()
    }
}

impl<C> Drop for Claim<C> {
    fn drop(&mut self) {
        Roles(self.roles.clone()).set().remove(&self.role);
    }
}
