package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/gozt/gozt/xds/state"
)

// metricsSweepEvery is how often the node drops the metric series of workloads that have
// left the workload store (a variable for tests).
var metricsSweepEvery = time.Minute

// forgetGoneWorkloads drops, every metricsSweepEvery, the metric series of workloads the
// store no longer has, so workloads that churn names do not grow /metrics for good.
func (n *ztunnel) forgetGoneWorkloads(ctx context.Context) error {
	t := time.NewTicker(metricsSweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		// The pairs the series name first (a dry run forgetting nothing), then one walk of
		// the store for those alone: a map of every workload's names, rebuilt every
		// minute, was seconds of CPU and hundreds of MB of garbage at a million workloads.
		asked := map[nsName]bool{}
		n.metrics.Forget(func(ns, w string) bool { asked[nsName{ns, w}] = false; return false })
		if dropped := n.metrics.Forget(goneFrom(n.store, asked)); dropped > 0 {
			slog.Debug("metrics: dropped the series of workloads that left", "label_sets", dropped)
		}
	}
}

type nsName struct{ ns, name string }

// goneFrom reports, for a metric label's (namespace, workload) among asked, whether no
// workload in store has that name now (the proxy labels a workload by its workload name,
// else its name); a pair not asked about is not gone. It marks asked's found pairs true.
func goneFrom(store *state.Store, asked map[nsName]bool) func(namespace, workload string) bool {
	if len(asked) > 0 {
		store.EachWorkload(func(w *state.Workload) {
			for _, name := range [2]string{w.Name, w.WorkloadName} {
				if _, ok := asked[nsName{w.Namespace, name}]; ok {
					asked[nsName{w.Namespace, name}] = true
				}
			}
		})
	}
	return func(ns, w string) bool {
		found, ok := asked[nsName{ns, w}]
		return ok && !found
	}
}
