//go:build !linux

package bench

import "errors"

func kernelTLSHere() error { return errors.New("kernel TLS is Linux's") }
