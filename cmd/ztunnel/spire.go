package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"

	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// CA_PROVIDER=spire: each workload the node serves gets its own SVIDs from the SPIRE
// agent's Delegated Identity API (identity/ca.Delegated), subscribed to by the selectors
// SPIRE's k8s workload attestor would give it. In-pod mode subscribes for each pod istio-cni
// hands over (its pod UID known) and for ztunnel's own workload, each pod's proxy
// presenting its own pod's SVIDs; node and dedicated mode for each HBONE workload of the
// node in the store (no pod UID there), their one proxy presenting an SVID of a workload
// with the identity a connection needs.

// errWithdrawn closes the connections of a workload whose SVIDs the agent withdrew.
var errWithdrawn = errors.New("the SPIRE agent withdrew the workload's SVIDs (its entry was deleted)")

// selfKey is the subscription key of ztunnel's own workload (the self-proxy).
const selfKey = "self"

// spireRef names a workload to the agent: key, namespace/name, and the selectors SPIRE's
// k8s workload attestor gives a pod of that namespace, service account and name on this
// node (with podUID when known).
func (n *ztunnel) spireRef(key, ns, name, sa, podUID string) certs.WorkloadRef {
	return certs.WorkloadRef{Key: key, Name: ns + "/" + name,
		As: ca.DelegatedWorkload{Selectors: ca.K8sSelectors(ns, sa, name, podUID, n.cfg.NodeName)}}
}

// podCerts is in-pod mode's podproxy.Config.PodCerts under SPIRE: the pod's own SVIDs.
func (n *ztunnel) podCerts(p inpod.Pod) (proxy.CertSource, func(), error) {
	return n.certs.Workload(n.spireRef(p.UID, p.Info.Namespace, p.Info.Name, p.Info.ServiceAccount, p.UID))
}

// closeWithdrawn is certs.Config.OnWithdraw: the workload's HBONE connections are closed,
// both ways, so that none goes on under an SVID the agent withdrew (new ones are refused
// for want of one). Node mode's one proxy carries every workload's connections under
// identities others may still hold: there only new handshakes are refused.
func (n *ztunnel) closeWithdrawn(key string) {
	all := func(bool, tls.ConnectionState) error { return errWithdrawn }
	switch {
	case key == selfKey && n.self != nil:
		n.self.CloseMatching(all)
	case n.pods != nil:
		n.pods.ClosePod(key, errWithdrawn)
	case n.proxy != nil && n.local.Dedicated():
		n.proxy.CloseMatching(all)
	}
}

// subscribeWorkloads is node and dedicated mode's certificate task under SPIRE: a
// subscription for each HBONE workload of the node in the store, dropped when it goes.
func (n *ztunnel) subscribeWorkloads(ctx context.Context) error {
	subs := map[string]func(){}
	defer func() {
		for _, release := range subs {
			release()
		}
	}()
	changes := n.store.Subscribe(ctx)
	for {
		want := map[string]*state.Workload{}
		for _, w := range n.local.Workloads(n.store) {
			if w.Protocol == state.TunnelHBONE || w.NativeTunnel {
				want[w.UID] = w
			}
		}
		for key, release := range subs {
			if want[key] == nil {
				release()
				delete(subs, key)
			}
		}
		for key, w := range want {
			if subs[key] == nil {
				_, release, err := n.certs.Workload(n.spireRef(key, w.Namespace, w.Name, w.ServiceAccount, ""))
				if err != nil {
					return err
				}
				subs[key] = release
			}
		}
		if _, open := <-changes; !open {
			return nil
		}
	}
}

// spireReady is the certificates readiness check under SPIRE: every subscribed workload
// holds an SVID, and a dedicated node's workload is known.
func (n *ztunnel) spireReady() error {
	err := n.certs.WorkloadsReady()
	if n.proxy != nil && n.local.Dedicated() && len(n.local.Workloads(n.store)) == 0 {
		err = errors.Join(err, fmt.Errorf("no HBONE workload %s (PROXY_WORKLOAD_INFO) in the workload store yet", n.local.Workload))
	}
	return err
}
