//go:build !linux

package zdsagent

import (
	"errors"

	"github.com/gozt/gozt/inpod/zdspb"
)

var errUnsupported = errors.New("network namespaces need Linux")

type listener struct{}

func listen(string) (listener, error)        { return listener{}, errUnsupported }
func (listener) close() error                { return nil }
func (listener) accept() (packetConn, error) { return packetConn{}, errUnsupported }

type packetConn struct{}

func (packetConn) close() {}
func (packetConn) request(*zdspb.WorkloadRequest, []int) (string, error) {
	return "", errUnsupported
}

func openNetNS(string) (int, error) { return -1, errUnsupported }
