package main

import (
	"encoding/json"
	"fmt"
	"html"
	"log/slog"
	"maps"
	"net/http"
	"net/http/pprof"
	"slices"
	"strings"
	"sync"
)

// readiness tracks the start-up tasks that must finish before the node reports ready, and
// why each one has not: /healthz/ready lists the pending tasks, then each one's last error.
type readiness struct {
	mu      sync.Mutex
	pending map[string]error        // guarded by mu: pending task -> its last error, nil if none yet
	checks  map[string]func() error // guarded by mu: task -> asked at each report; nil = ready
}

func newReadiness() *readiness {
	return &readiness{pending: map[string]error{}, checks: map[string]func() error{}}
}

// watch adds a task whose state is asked for at each report: pending while check fails
// (the workload manager's readiness comes and goes with the node agent).
func (r *readiness) watch(task string, check func() error) {
	r.mu.Lock()
	r.checks[task] = check
	r.mu.Unlock()
}

// add registers a task; done clears it. A task that is never added is never waited for.
func (r *readiness) add(task string) {
	r.mu.Lock()
	r.pending[task] = nil
	r.mu.Unlock()
}

func (r *readiness) done(task string) {
	r.mu.Lock()
	delete(r.pending, task)
	r.mu.Unlock()
}

// failed records err as why task is still pending; a task that is done stays done.
func (r *readiness) failed(task string, err error) {
	r.mu.Lock()
	if _, ok := r.pending[task]; ok {
		r.pending[task] = err
	}
	r.mu.Unlock()
}

// report is what /healthz/ready answers while tasks are pending ("" when none are): the
// line Istio's ztunnel writes, then "task: error" for each line of each task's last error.
func (r *readiness) report() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	pending := maps.Clone(r.pending)
	for task, check := range r.checks {
		if err := check(); err != nil {
			pending[task] = err
		}
	}
	if len(pending) == 0 {
		return ""
	}
	tasks := slices.Sorted(maps.Keys(pending))
	var b strings.Builder
	fmt.Fprintf(&b, "not ready, pending: %s\n", strings.Join(tasks, ", "))
	for _, t := range tasks {
		if err := pending[t]; err != nil {
			for line := range strings.Lines(err.Error()) {
				fmt.Fprintf(&b, "%s: %s\n", t, strings.TrimSuffix(line, "\n"))
			}
		}
	}
	return b.String()
}

func (r *readiness) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.URL.Path != "/healthz/ready" {
		http.NotFound(w, req)
		return
	}
	if p := r.report(); p != "" {
		w.WriteHeader(http.StatusInternalServerError)
		fmt.Fprint(w, p)
		return
	}
	fmt.Fprint(w, "ready\n")
}

// loggingUsage is /logging's help, in the Rust ztunnel's words where they apply.
const loggingUsage = `usage: POST /logging					(To list current level)
usage: POST /logging?level=<level>				(To change global levels)
usage: POST /logging?level={mod1}:{level1},{mod2}:{level2}	(To change specific mods' logging level)
usage: POST /logging?reset[&level=...]				(To restore the levels at start first)

hint: loglevel:	error|warn|info|debug|trace|off
hint: mod_name:	access|dns (ztunnel::access also names access)
`

// adminHandler serves the admin port: an index, the config dump, log levels, shutdown and
// pprof. dump returns the sections of /config_dump; quit starts a graceful shutdown.
func adminHandler(levels *logLevels, dump func() map[string]any, quit func()) http.Handler {
	mux := http.NewServeMux()
	endpoints := []struct{ path, help string }{
		{"/config_dump", "workloads, services, policies, certificates, config, version, kernelTls and (in-pod mode) workloadState as JSON"},
		{"/logging", "POST lists the log levels; ?level=info,access=debug (or access:debug) sets them, &reset first restores the levels at start"},
		{"/quitquitquit", "POST starts a graceful shutdown"},
		{"/debug/pprof/", "Go profiles"},
	}
	mux.HandleFunc("/{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprint(w, "<html><head><title>ztunnel admin</title></head><body><h1>ztunnel (gozt) admin</h1><ul>\n")
		for _, e := range endpoints {
			fmt.Fprintf(w, "<li><a href=%q>%s</a>: %s</li>\n", e.path, e.path, html.EscapeString(e.help))
		}
		fmt.Fprint(w, "</ul></body></html>\n")
	})
	mux.HandleFunc("/config_dump", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(dump()); err != nil {
			slog.Warn("admin: config dump", "err", err)
		}
	})
	mux.HandleFunc("/logging", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.WriteHeader(http.StatusMethodNotAllowed)
			fmt.Fprint(w, loggingUsage)
			return
		}
		q := r.URL.Query()
		if _, reset := q["reset"]; reset || q.Get("level") != "" {
			if err := levels.apply(q.Get("level"), reset); err != nil {
				w.WriteHeader(http.StatusBadRequest)
				fmt.Fprintf(w, "Invalid level provided: %v\n%s", err, loggingUsage)
				return
			}
		}
		fmt.Fprintf(w, "current log level is %s\n", levels)
	})
	mux.HandleFunc("/quitquitquit", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "use POST", http.StatusMethodNotAllowed)
			return
		}
		fmt.Fprint(w, "shutdown now\n")
		quit()
	})
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}
