package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// node is one running ztunnel: what run starts, in one place, so tests can start several in
// one process and look at their bound addresses.
type node struct {
	cfg      *config
	logLevel *slog.LevelVar
	ready    *readiness
	registry *prometheus.Registry

	quitOnce sync.Once
	quit     chan struct{} // closed by POST /quitquitquit

	addrs map[string]net.Addr // bound listener addresses by setting name, e.g. "ADMIN_ADDR"
}

// run starts a node and blocks until ctx ends or /quitquitquit is called, then drains.
// started, if not nil, is called once every listener is bound.
func run(ctx context.Context, cfg *config, logLevel *slog.LevelVar, started func(*node)) error {
	n := &node{
		cfg:      cfg,
		logLevel: logLevel,
		ready:    newReadiness(),
		registry: prometheus.NewRegistry(),
		quit:     make(chan struct{}),
		addrs:    map[string]net.Addr{},
	}
	var servers []*http.Server
	var wg sync.WaitGroup
	defer wg.Wait()
	serve := func(name, addr string, h http.Handler) error {
		if addr == "" {
			return nil
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("listen %s=%s: %w", name, addr, err)
		}
		n.addrs[name] = ln.Addr()
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 2 * time.Second}
		servers = append(servers, srv)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				slog.Error("http server", "listener", name, "err", err)
			}
		}()
		return nil
	}
	closeServers := func() {
		for _, s := range servers {
			s.Close()
		}
	}

	admin := adminHandler(logLevel, n.configDump, n.requestQuit)
	stats := promhttp.HandlerFor(n.registry, promhttp.HandlerOpts{EnableOpenMetrics: true})
	statsMux := http.NewServeMux()
	statsMux.Handle("/metrics", stats)
	statsMux.Handle("/stats/prometheus", stats)
	for _, l := range []struct {
		name, addr string
		h          http.Handler
	}{
		{"ADMIN_ADDR", cfg.AdminAddr, admin},
		{"STATS_ADDR", cfg.StatsAddr, statsMux},
		{"READINESS_ADDR", cfg.ReadinessAddr, n.ready},
	} {
		if err := serve(l.name, l.addr, l.h); err != nil {
			closeServers()
			return err
		}
	}
	slog.Info("ztunnel started", "version", version, "admin", n.addrs["ADMIN_ADDR"], "mode", cfg.ProxyMode)
	if started != nil {
		started(n)
	}

	select {
	case <-ctx.Done():
	case <-n.quit:
	}
	slog.Info("draining", "deadline", cfg.TerminationDeadline)
	drainCtx, cancel := context.WithTimeout(context.Background(), cfg.TerminationDeadline)
	defer cancel()
	for _, s := range servers {
		_ = s.Shutdown(drainCtx)
	}
	closeServers()
	slog.Info("ztunnel stopped")
	return nil
}

func (n *node) requestQuit() { n.quitOnce.Do(func() { close(n.quit) }) }

func (n *node) configDump() map[string]any {
	return map[string]any{
		"version": map[string]string{"version": version, "buildInfo": versionString()},
		"config":  n.cfg,
	}
}
