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
func (n *node) forgetGoneWorkloads(ctx context.Context) error {
	t := time.NewTicker(metricsSweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if dropped := n.metrics.Forget(goneFrom(n.store)); dropped > 0 {
			slog.Debug("metrics: dropped the series of workloads that left", "label_sets", dropped)
		}
	}
}

// goneFrom reports, for a metric label's (namespace, workload), whether no workload in
// store has that name now (the proxy labels a workload by its workload name, else its
// name).
func goneFrom(store *state.Store) func(namespace, workload string) bool {
	type nsName struct{ ns, name string }
	known := map[nsName]bool{}
	store.EachWorkload(func(w *state.Workload) {
		known[nsName{w.Namespace, w.Name}] = true
		if w.WorkloadName != "" {
			known[nsName{w.Namespace, w.WorkloadName}] = true
		}
	})
	return func(ns, w string) bool { return !known[nsName{ns, w}] }
}
