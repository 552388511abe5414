//! [`AuthorityBudgets`]: a budget per authority, for a layer in front of a client shared by
//! several hosts ([`budget_per_authority`](crate::RetryPolicyBuilder::budget_per_authority)).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use http::uri::Authority;

use super::{Budget, BudgetChoice};

/// The budgets of the authorities a layer has called, each made from the policy's shape.
#[derive(Debug)]
pub(crate) struct AuthorityBudgets {
    shape: BudgetChoice,
    max: usize,
    by_authority: RwLock<HashMap<Authority, Arc<dyn Budget>>>,
}

impl AuthorityBudgets {
    pub(crate) fn new(shape: BudgetChoice, max: usize) -> Self {
        AuthorityBudgets {
            shape,
            max,
            by_authority: RwLock::new(HashMap::new()),
        }
    }

    /// The budget of `authority`, made on its first call; `None` once `max` authorities have
    /// one (the caller then uses the layer's).
    pub(crate) fn of(&self, authority: &Authority) -> Option<Arc<dyn Budget>> {
        let known = self
            .by_authority
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(authority)
            .cloned();
        if known.is_some() {
            return known;
        }
        let mut all = self.by_authority.write().unwrap_or_else(|p| p.into_inner());
        if let Some(budget) = all.get(authority) {
            return Some(budget.clone());
        }
        if all.len() >= self.max {
            return None;
        }
        let budget = self.shape.make();
        all.insert(authority.clone(), budget.clone());
        Some(budget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_budget_per_authority_up_to_the_cap() {
        let budgets = AuthorityBudgets::new(BudgetChoice::default(), 2);
        let a = Authority::from_static("a.example:443");
        let b = Authority::from_static("b.example:443");
        let first = budgets.of(&a).unwrap();
        assert!(Arc::ptr_eq(&first, &budgets.of(&a).unwrap()));
        assert!(!Arc::ptr_eq(&first, &budgets.of(&b).unwrap()));
        assert!(budgets.of(&Authority::from_static("c.example")).is_none());
        // Authorities compare without regard to case, as hosts do.
        assert!(Arc::ptr_eq(
            &first,
            &budgets
                .of(&Authority::from_static("A.EXAMPLE:443"))
                .unwrap()
        ));
    }
}
