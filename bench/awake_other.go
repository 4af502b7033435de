//go:build !linux

package bench

import "errors"

// keepAwake fails: SCHED_IDLE is Linux's.
func keepAwake(work string) ([]*child, error) {
	return nil, errors.New("bench: keeping vCPUs awake (SCHED_IDLE) needs Linux")
}
