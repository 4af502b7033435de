package main

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// chartSettings are the variables Istio's ztunnel chart sets that have no gozt name of their
// own (manifests/charts/ztunnel), so the DaemonSet runs gozt unchanged. Each maps onto a
// gozt setting in resolveSources, or is accepted and reported by unusedChartVars.
func chartSettings() []setting {
	return []setting{
		str("RUST_LOG", "", "log level when LOG_LEVEL is unset: a level (trace, debug, info, warn, error, off) and target=level pairs, comma-separated; targets access and dns map to gozt's log scopes, others are reported at start and ignored", func(c *config) *string { return &c.chart.rustLog }),
		str("TERMINATION_GRACE_PERIOD_SECONDS", "", "the pod's grace period; when CONNECTION_TERMINATION_DEADLINE is unset the drain deadline is this minus 5s (minus 1s at 10s or less), at least 1s, as the Rust ztunnel does", func(c *config) *string { return &c.chart.gracePeriod }),
		str("ZTUNNEL_CPU_LIMIT", "", "the container's CPU limit in whole cores (downward API limits.cpu); caps the cores ZTUNNEL_WORKER_THREADS counts", func(c *config) *string { return &c.chart.cpuLimit }),
		str("ZTUNNEL_RESOURCE_CPU_LIMIT", "", "the chart's resources.limits.cpu (a quantity: 2, 500m), rounded up to cores; same use as ZTUNNEL_CPU_LIMIT", func(c *config) *string { return &c.chart.resourceCPULimit }),
		chartOnly("ZTUNNEL_RESOURCE_CPU_REQUEST", "the chart's resources.requests.cpu; not used (threads follow the limit)"),
		str("SERVICE_ACCOUNT", "", "ztunnel's service account: with POD_NAME and POD_NAMESPACE, in shared mode, ztunnel serves HBONE on INBOUND_ADDR's port in its own network namespace as its own workload (the self-proxy), so a meshed client such as Prometheus reaches its stats port over mTLS", func(c *config) *string { return &c.ServiceAccount }),
		goztOnly(chartOnly("INPOD_ENABLED", "set by the chart; not used (in-pod mode follows PROXY_MODE, as in the Rust ztunnel today)")),
		chartOnly("RUST_BACKTRACE", "set by the chart; not used (Go prints every goroutine's stack on a crash; see GOTRACEBACK)"),
	}
}

// chartOnly is a variable that is accepted and reported at start, never acted on.
func chartOnly(env, help string) setting {
	return setting{env: env, form: "any string", help: help, unused: true, set: func(*config, string) error { return nil }}
}

// chartEnv holds the raw chart variables until resolveSources maps them.
type chartEnv struct {
	rustLog, gracePeriod, cpuLimit, resourceCPULimit string
	unused                                           []string // variables set but not acted on, with why
}

// drainDeadline leaves Kubernetes' SIGKILL a margin after gozt's own forced close (which
// ends streams and TLS cleanly), as the Rust ztunnel derives it from the grace period.
func drainDeadline(graceSecs uint64) time.Duration {
	d := graceSecs - 1
	if graceSecs > 10 {
		d = graceSecs - 5
	}
	if graceSecs == 0 {
		d = 0
	}
	return time.Duration(max(d, 1)) * time.Second
}

// cpuCores reads a Kubernetes CPU quantity (2, 1.5, 500m) as whole cores, rounded up.
func cpuCores(v string) (int, error) {
	milli := false
	if n, ok := strings.CutSuffix(v, "m"); ok {
		v, milli = n, true
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 || math.IsInf(f, 0) {
		return 0, errors.New("not a positive number")
	}
	if milli {
		f /= 1000
	}
	return int(min(math.Ceil(f), 1<<16)), nil
}

// parseRustLog reads an env_logger/tracing directive list such as "info,access=debug"
// (parseDirectives' forms): the bare level is the default, target=level sets one scope, in
// slog's level names. Targets gozt has no logger for are returned in ignored.
func parseRustLog(v string) (level string, scopes map[string]string, ignored []string, err error) {
	changes, err := parseDirectives(v)
	if err != nil {
		return "", nil, nil, err
	}
	level = "info"
	for _, c := range changes {
		switch {
		case c.scope == "":
			level = strings.ToLower(c.level.String())
		case slices.Contains(logScopes, c.scope):
			if scopes == nil {
				scopes = map[string]string{}
			}
			scopes[c.scope] = strings.ToLower(c.level.String())
		default:
			ignored = append(ignored, c.target)
		}
	}
	return level, scopes, ignored, nil
}

// rustLevel maps a Rust log level onto slog's: trace is debug, off is above error.
func rustLevel(v string) (string, error) {
	switch l := strings.ToLower(v); l {
	case "trace", "debug":
		return "debug", nil
	case "info", "warn", "error":
		return l, nil
	case "off":
		return "error+8", nil
	}
	return "", fmt.Errorf("unknown level %q", v)
}
