fn main() {
    let from: u64 = std::env::args().nth(1).unwrap().parse().unwrap();
    let n: u64 = std::env::args().nth(2).unwrap().parse().unwrap();
    for seed in from..from + n {
        let s = sim::schedule::Schedule::draw(seed);
        let Some(max) = s.settings.bounds.max_response_buffer_bytes else {
            continue;
        };
        let r = sim::run_seed(seed);
        let slow = s
            .intents
            .iter()
            .flat_map(|i| i.sends.iter())
            .filter(|x| x.slow_read.is_some())
            .count();
        println!(
            "{seed}: max {max} peak {} slow sends {slow} violations {}",
            r.run.observed.peaks.response_buffer_bytes,
            r.verdict.violations.len()
        );
    }
}
