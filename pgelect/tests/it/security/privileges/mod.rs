//! Least privilege: the grants each kind of user needs, and a schema owner who
//! is not a superuser.

mod needed_grants;
mod non_superuser_owner;
