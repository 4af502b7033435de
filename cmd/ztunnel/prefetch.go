package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/xds/state"
)

// prefetchCertificates keeps a certificate ready for every workload this node serves:
// fetched when the workload appears, forgotten when the last one with that identity goes.
// The node is ready once the current set has been fetched; failures are retried every 5s
// and shown at readiness (the certificate manager logs them).
func (n *ztunnel) prefetchCertificates(ctx context.Context) error {
	have := map[identity.ID]bool{}
	changes := n.store.Subscribe(ctx)
	for {
		var retry <-chan time.Time
		if err := n.syncCertificates(ctx, have); err != nil {
			n.ready.failed(taskCerts, err)
			retry = time.After(5 * time.Second)
		} else {
			n.ready.done(taskCerts)
		}
		select {
		case _, open := <-changes:
			if !open {
				return nil
			}
		case <-retry:
		}
	}
}

// syncCertificates prefetches new identities, forgets gone ones and returns why a wanted
// certificate is not available, nil when every one is.
func (n *ztunnel) syncCertificates(ctx context.Context, have map[identity.ID]bool) error {
	want := map[identity.ID]bool{}
	for _, w := range n.local.Workloads(n.store) {
		if w.Protocol == state.TunnelHBONE || w.NativeTunnel {
			want[w.Identity()] = true
		}
	}
	for id := range have {
		if !want[id] {
			n.certs.Forget(id)
			delete(have, id)
		}
	}
	var errs []error
	if len(want) == 0 && n.local.Dedicated() {
		errs = append(errs, fmt.Errorf("no HBONE workload %s (PROXY_WORKLOAD_INFO) in the workload store yet", n.local.Workload))
	}
	byName := func(a, b identity.ID) int { return strings.Compare(a.String(), b.String()) }
	for _, id := range slices.SortedFunc(maps.Keys(want), byName) {
		if !have[id] {
			n.certs.Prefetch(id)
			have[id] = true
		}
		fetchCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		if _, err := n.certs.Certificate(fetchCtx, id); err != nil {
			errs = append(errs, err)
		}
		cancel()
	}
	return errors.Join(errs...)
}
