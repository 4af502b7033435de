// Command ztunnel is gozt's node proxy: it reads its configuration, starts the data-plane
// listeners, the control-plane and CA clients, and the admin, stats and readiness servers,
// and drains on SIGTERM.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"syscall"
	"time"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(mainExit(os.Args[1:]))
}

func mainExit(args []string) int {
	// Istio's chart runs the image with args [proxy, ztunnel] (pilot-agent's command line
	// for this proxy type).
	if len(args) >= 2 && args[0] == "proxy" && args[1] == "ztunnel" {
		args = args[2:]
	}
	if len(args) > 0 {
		switch args[0] {
		case "version", "--version", "-version":
			fmt.Println(versionString())
			return 0
		case "help", "--help", "-help", "-h":
			fmt.Print(usage())
			return 0
		case "config-table":
			fmt.Print(markdownTable())
			return 0
		}
	}
	if err := currentFIPS().check(); err != nil {
		fmt.Fprintln(os.Stderr, "ztunnel:", err)
		return 2
	}
	reexecWithSysmonPolling()
	cfg, err := loadConfig(osGetenv, os.Environ(), args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "ztunnel:", err)
		return 2
	}
	_, gomaxprocsSet := os.LookupEnv("GOMAXPROCS")
	goDefault := runtime.GOMAXPROCS(0)
	if n := cfg.WorkerThreads.threads(runtime.NumCPU(), cfg.CPULimit, goDefault, gomaxprocsSet); n != goDefault {
		// Only when it differs: setting it stops the runtime following a changed CPU limit.
		runtime.GOMAXPROCS(n)
	}
	logs := newLogWriter(os.Stderr, 100*time.Millisecond)
	defer logs.Close()
	logLevel, err := newLogLevels(cfg.LogLevel, cfg.LogScopes)
	if err != nil {
		fmt.Fprintln(os.Stderr, "ztunnel: config:", err)
		return 2
	}
	slog.SetDefault(newLogger(cfg, logLevel, logs))
	for _, u := range cfg.chart.unused {
		slog.Info("chart variable accepted, not acted on", "variable", u)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, cfg, logLevel, nil); err != nil {
		slog.Error("ztunnel stopped", "err", err)
		return 1
	}
	return 0
}

func newLogger(cfg *config, levels *logLevels, w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.Level(math.MinInt)} // scopeHandler decides
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if cfg.LogFormat == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(newScopeHandler(h, levels))
}

func versionString() string {
	rev := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				rev = s.Value
			}
		}
		s := fmt.Sprintf("ztunnel (gozt) %s revision %s %s", version, rev, bi.GoVersion)
		if f := currentFIPS(); f.Build != "off" {
			s += " GOFIPS140=" + f.Build
		}
		return s
	}
	return "ztunnel (gozt) " + version
}
