use sim::schedule::{Fault, Schedule};
fn main() {
    for a in std::env::args().skip(1) {
        let seed: u64 = a.parse().unwrap();
        let s = Schedule::draw(seed);
        let mut new = Vec::new();
        for t in &s.faults {
            match t.fault {
                Fault::OneWay { .. } | Fault::Downstream { .. } | Fault::ServicePanic { .. } => {
                    new.push(format!("{:?}", t.fault))
                }
                _ => {}
            }
        }
        for i in &s.intents {
            for se in &i.sends {
                if let Some(f) = se.body_fault {
                    new.push(format!("{f:?}"));
                }
            }
        }
        if s.settings
            .per_server
            .iter()
            .any(|p| p.request_body_timeout.is_some())
        {
            new.push("rbt".into());
        }
        println!(
            "{seed}: {}",
            if new.is_empty() {
                "unchanged".to_string()
            } else {
                new.join(", ")
            }
        );
    }
}
