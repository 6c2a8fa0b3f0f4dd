//! vLLM's Prometheus exposition read for what routing needs: load gauges, KV capacity, the
//! prefill counters and the data-parallel engines it shows.

use super::Polled;

/// Reads vLLM's load gauges from a Prometheus text exposition, summing label sets, and what its
/// KV cache holds ([`KvClock`](super::KvClock)). `None` when none of the gauges is there (not a vLLM worker, or
/// not yet serving). With `engine`, only that data-parallel engine's series (vLLM's `engine`
/// label is the rank) and those of no engine count.
pub fn parse_vllm_metrics(text: &str, engine: Option<u32>) -> Option<Polled> {
    let mut p = Polled::default();
    let mut seen = false;
    // Releases that show both name the same count twice; the older name counts only alone.
    let mut gpu_hits = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("vllm:") else {
            if let Some(v) = line.strip_prefix("process_start_time_seconds ") {
                p.started = v.trim().parse::<f64>().ok().filter(|v| v.is_finite());
            }
            continue;
        };
        let name_end = rest.find(['{', ' ']).unwrap_or(rest.len());
        if engine.is_some_and(|rank| engine_of(rest).is_some_and(|e| e != Some(rank))) {
            continue;
        }
        let Some(value) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        let slot = match &rest[..name_end] {
            "num_requests_running" => &mut p.running,
            "num_requests_waiting" => &mut p.waiting,
            // `gpu_cache_usage_perc` before vLLM 0.10.
            "kv_cache_usage_perc" | "gpu_cache_usage_perc" => &mut p.kv_usage,
            "cache_config_info" => {
                let blocks = label(rest, "num_gpu_blocks").and_then(|v| v.parse::<f64>().ok());
                let size = label(rest, "block_size").and_then(|v| v.parse::<f64>().ok());
                if let (Some(blocks), Some(size)) = (blocks, size) {
                    p.kv_capacity += blocks * size;
                }
                continue;
            }
            "prompt_tokens_total" => {
                *p.prompt_tokens.get_or_insert(0.0) += value;
                continue;
            }
            "prefix_cache_hits_total" => {
                *p.prefix_hits.get_or_insert(0.0) += value;
                continue;
            }
            "gpu_prefix_cache_hits_total" => {
                *gpu_hits.get_or_insert(0.0) += value;
                continue;
            }
            "prompt_tokens_by_source_total" => {
                if label(rest, "source") == Some("local_compute") {
                    *p.prompt_computed.get_or_insert(0.0) += value;
                }
                continue;
            }
            _ => continue,
        };
        *slot += value;
        seen = true;
    }
    p.prefix_hits = p.prefix_hits.or(gpu_hits);
    seen.then_some(p)
}

/// The data-parallel engine a vLLM sample is of (its `engine` label, the rank): `None` for a
/// sample of no engine, `Some(None)` for one whose label is not a rank.
pub(crate) fn engine_of(sample: &str) -> Option<Option<u32>> {
    label(sample, "engine").map(|e| e.parse().ok())
}

/// The value of label `name` in a sample's `{...}`, unescaped values only (vLLM's numbers).
pub(crate) fn label<'a>(sample: &'a str, name: &str) -> Option<&'a str> {
    let labels = &sample[sample.find('{')? + 1..sample.find('}')?];
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// The data-parallel engines a vLLM exposition shows: the ranks its samples' `engine` labels
/// name, in order. `None` when a label is not a rank below [`MAX_DATA_PARALLEL_SIZE`]: what the
/// worker serves is then not read as ranks.
///
/// [`MAX_DATA_PARALLEL_SIZE`]: crate::config::MAX_DATA_PARALLEL_SIZE
pub fn engine_ranks(text: &str) -> Option<Vec<u32>> {
    let mut ranks = std::collections::BTreeSet::new();
    for sample in text.lines().filter_map(|l| l.strip_prefix("vllm:")) {
        match engine_of(sample) {
            None => {}
            Some(Some(r)) if r < crate::config::MAX_DATA_PARALLEL_SIZE => {
                ranks.insert(r);
            }
            Some(_) => return None,
        }
    }
    Some(ranks.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllms_gauges_summed_over_engines() {
        let text =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:num_requests_waiting_by_reason{reason=\"x\"} 9.0\n\
            vllm:prompt_tokens_total{engine=\"0\"} 1000.0\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 600.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\"} 20.0\n\
            vllm:gpu_prefix_cache_hits_total{engine=\"0\"} 600.0\n";
        let p = parse_vllm_metrics(text, None).unwrap();
        assert_eq!(
            p,
            Polled {
                running: 5.0,
                waiting: 4.0,
                kv_usage: 0.25,
                kv_capacity: 0.0,
                prompt_tokens: Some(1000.0),
                started: None,
                // The deprecated name of the same count is not added to it.
                prefix_hits: Some(620.0),
                prompt_computed: None,
            }
        );
        assert_eq!(p.prefilled(), Some(380.0), "prompt tokens less hits");
        // Where the worker counts what it prefilled, that count.
        let by_source = format!(
            "{text}vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_compute\"}} 390.0\n\
            vllm:prompt_tokens_by_source_total{{engine=\"1\",model_name=\"m\",source=\"local_compute\"}} 5.0\n\
            vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_cache_hit\"}} 610.0\n\
            vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"}} 0.0\n"
        );
        let p = parse_vllm_metrics(&by_source, None).unwrap();
        assert_eq!(p.prompt_computed, Some(395.0));
        assert_eq!(p.prefilled(), Some(395.0));
        // A release that shows only the old name.
        let old = "vllm:num_requests_running 1\nvllm:gpu_prefix_cache_hits_total 7.0\n";
        assert_eq!(
            parse_vllm_metrics(old, None).unwrap().prefix_hits,
            Some(7.0)
        );
        assert_eq!(parse_vllm_metrics("other_metric 1\n", None), None);
    }

    #[test]
    fn the_engines_an_exposition_shows_are_its_ranks() {
        let text = "vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 0.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
            other_metric{engine=\"7\"} 1\n\
            process_start_time_seconds 1.0\n";
        assert_eq!(engine_ranks(text), Some(vec![0, 1]));
        assert_eq!(engine_ranks("vllm:num_requests_running 0\n"), Some(vec![]));
        // A label that is no rank, or beyond any size kvroute expands to, is not read as ranks.
        let odd = "vllm:num_requests_running{engine=\"x\"} 0\n";
        assert_eq!(engine_ranks(odd), None);
        let far = "vllm:num_requests_running{engine=\"100000\"} 0\n";
        assert_eq!(engine_ranks(far), None);
    }

    #[test]
    fn one_data_parallel_rank_reads_its_own_engines_series_only() {
        let text = "process_start_time_seconds 1700000000.5\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 1.0\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"300\"} 1.0\n\
            vllm:prompt_tokens_total{engine=\"0\"} 1000.0\n\
            vllm:prompt_tokens_total{engine=\"1\"} 70.0\n";
        let one = parse_vllm_metrics(text, Some(1)).unwrap();
        assert_eq!(
            one,
            Polled {
                running: 2.0,
                waiting: 1.0,
                kv_usage: 0.5,
                kv_capacity: 300.0 * 16.0,
                prompt_tokens: Some(70.0),
                started: Some(1700000000.5),
                prefix_hits: None,
                prompt_computed: None,
            }
        );
        let zero = parse_vllm_metrics(text, Some(0)).unwrap();
        assert_eq!((zero.running, zero.waiting), (3.0, 4.0));
        assert_eq!(zero.prompt_tokens, Some(1000.0));
        // A rank the server does not have shows no gauges: not read as an idle worker.
        assert_eq!(parse_vllm_metrics(text, Some(2)), None);
    }

    #[test]
    fn reads_the_kv_capacity_summed_over_engines() {
        let text = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"5400\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"100\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"2\"} 1.0\n";
        let p = parse_vllm_metrics(text, None).unwrap();
        assert_eq!(
            p.kv_capacity,
            5500.0 * 16.0,
            "an engine without its block count adds none"
        );
        let p = parse_vllm_metrics("vllm:num_requests_running 1.0\n", None).unwrap();
        assert_eq!(p.kv_capacity, 0.0);
    }
}
