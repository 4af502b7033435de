// Package zdsagent is the old path of inpod/zdsagent, kept only so that the load generator
// (bench/capture.go) builds until it imports the new one; delete it then. Nothing else may
// import it.
package zdsagent

import "github.com/gozt/gozt/inpod/zdsagent"

// Pod is zdsagent.Pod.
type Pod = zdsagent.Pod

// Agent is zdsagent.Agent.
type Agent = zdsagent.Agent

// Conn is zdsagent.Conn.
type Conn = zdsagent.Conn

// Listen is zdsagent.Listen.
func Listen(path string, pods ...Pod) (*Agent, error) { return zdsagent.Listen(path, pods...) }
