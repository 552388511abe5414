//! [`MethodConfigs`]: the rules of a gRPC service config's `methodConfig` entries, found by a
//! request's method path.

use std::collections::HashMap;

use super::Rules;

/// The rules of a gRPC service config's `methodConfig` entries, by method path.
#[derive(Debug, Clone)]
pub(crate) struct MethodConfigs<T = Rules> {
    pub(crate) rules: Vec<T>,
    /// `/package.Service/Method` or `/package.Service/` to an index in `rules`.
    by_name: HashMap<String, usize>,
    /// The entry with an empty name (`{}`): every method no other entry names.
    default: Option<usize>,
}

impl<T> Default for MethodConfigs<T> {
    fn default() -> Self {
        MethodConfigs {
            rules: Vec::new(),
            by_name: HashMap::new(),
            default: None,
        }
    }
}

impl<T> MethodConfigs<T> {
    /// The entry that applies to `path`: its method's, else its service's, else the default.
    pub(crate) fn find(&self, path: &str) -> Option<usize> {
        if let Some(i) = self.by_name.get(path) {
            return Some(*i);
        }
        let service = match path.rfind('/') {
            Some(i) if i > 0 => self.by_name.get(&path[..=i]).copied(),
            _ => None,
        };
        service.or(self.default)
    }

    #[cfg(feature = "service-config")]
    pub(crate) fn insert(&mut self, name: Option<String>, rules: T) -> Result<(), String> {
        let i = self.rules.len();
        match name {
            None if self.default.is_some() => {
                return Err("two methodConfig entries have an empty name".into())
            }
            None => self.default = Some(i),
            Some(n) if self.by_name.contains_key(&n) => {
                return Err(format!("{n:?} is named by two methodConfig entries"))
            }
            Some(n) => {
                self.by_name.insert(n, i);
            }
        }
        self.rules.push(rules);
        Ok(())
    }
}
