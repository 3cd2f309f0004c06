//! Example sources: real connectors that are also the templates for custom ones.

pub mod files;
